"""Repro of issue 10's critical #1 against a given orbitkv package: a request
with bogus kv_transfer_params sent straight to a vLLM server with the
PdConnector. Prints whether the server survived and answered."""
import json
import os
import subprocess
import sys
import time
import urllib.request

site, model, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
env = dict(os.environ)
env.update({"PYTHONPATH": site, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_TARGET_DEVICE": "cpu",
            "TORCHDYNAMO_DISABLE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0", "VLLM_NO_USAGE_STATS": "1",
            "VLLM_HOST_IP": "127.0.0.1", "GLOG_minloglevel": "1"})
env.pop("VLLM_CPU_KVCACHE_SPACE", None)
cfg = {"kv_connector": "PdConnector", "kv_connector_module_path": "orbitkv.vllm.pd", "kv_role": "kv_both",
       "kv_connector_extra_config": {"orbitkv.pd.mooncake.bind_host": "127.0.0.1", "orbitkv.pd.side_channel_port": port + 1}}
argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--served-model-name", "tiny",
        "--dtype", "float32", "--enforce-eager", "--kv-cache-memory-bytes", str(128 << 20), "--host", "127.0.0.1",
        "--port", str(port), "--kv-transfer-config", json.dumps(cfg)]
log = open(f"/tmp/repro1-{port}.log", "w")
p = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
url = f"http://127.0.0.1:{port}"
try:
    for _ in range(300):
        try:
            if urllib.request.urlopen(url + "/health", timeout=2).status == 200:
                break
        except OSError:  # not listening yet
            time.sleep(1)
    print("server up; orbitkv in server from", site, flush=True)
    body = {"model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": 4, "temperature": 0,
            "kv_transfer_params": {"orbitkv_role": "bogus", "orbitkv_request": "x"}}
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        r = urllib.request.urlopen(req, timeout=60)
        print("bogus request answered", r.status, flush=True)
    except OSError as e:  # the server died under it (connection reset, 500)
        print("bogus request failed:", type(e).__name__, e, flush=True)
    time.sleep(5)
    alive = p.poll() is None
    try:
        ok = urllib.request.urlopen(url + "/health", timeout=5).status == 200
    except OSError:
        ok = False
    print(f"RESULT server process alive={alive} healthy={ok}", flush=True)
finally:
    if p.poll() is None:
        os.killpg(p.pid, 15)
        p.wait(30)
