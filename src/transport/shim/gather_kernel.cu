// The writer's gather kernel: copies[i].len bytes from copies[i].src to
// copies[i].dst, for every i < n. One block per copy (blocks stride over the
// copies when there are more than the grid); threads stride over the copy's
// 16-byte words, 4 in flight a thread. Every address and length must be a
// multiple of 16 bytes: the shim (okv_cuda_gather_wait) checks, and sends a
// list with any other copy to the copy engines instead.
#define OKV_GLOBAL __attribute__((global))
typedef unsigned long long u64;
typedef unsigned int u32;
struct Copy {
  u64 dst;
  u64 src;
  u64 len;
};
typedef u32 Word16 __attribute__((ext_vector_type(4)));

extern "C" OKV_GLOBAL void okv_gather(const Copy* __restrict__ copies, u32 n) {
  const u64 tid = __nvvm_read_ptx_sreg_tid_x();
  const u64 threads = __nvvm_read_ptx_sreg_ntid_x();
  for (u32 i = __nvvm_read_ptx_sreg_ctaid_x(); i < n; i += __nvvm_read_ptx_sreg_nctaid_x()) {
    const u64 dst = copies[i].dst;
    const u64 src = copies[i].src;
    const u64 len = copies[i].len;
    // 16-byte multiples only (the shim sends any other copy to the copy
    // engines)
    const Word16* __restrict__ s = (const Word16*)src;
    Word16* __restrict__ d = (Word16*)dst;
    const u64 words = len >> 4;
    u64 j = tid;
    for (; j + 3 * threads < words; j += 4 * threads) {
      Word16 w0 = s[j];
      Word16 w1 = s[j + threads];
      Word16 w2 = s[j + 2 * threads];
      Word16 w3 = s[j + 3 * threads];
      d[j] = w0;
      d[j + threads] = w1;
      d[j + 2 * threads] = w2;
      d[j + 3 * threads] = w3;
    }
    for (; j < words; j += threads) d[j] = s[j];
  }
}
