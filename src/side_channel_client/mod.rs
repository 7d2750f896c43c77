//! The side channel's protocol as a sender sees it: its paths, the
//! deployment key's signature ([`sign`], [`verify`]), and its HTTP client:
//! one POST ([`post`]) and a POST tried again while the answer is `503`
//! ([`post_while_busy`]), signed with the deployment key when given. Pure
//! HTTP over `std::net`: it knows nothing of the actors or of the server
//! ([`crate::side_channel`], which serves these paths on a prefill rank and
//! checks these signatures). Its users: the decode side's publisher
//! ([`crate::actors::decode::publisher`], which reports what a prefill rank
//! answered to the consumer that sent it) and Python's
//! `orbitkv.vllm.side_channel` (through the binding's `side_channel_post`).

use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

mod signature;

pub use signature::{sign, verify, SIGNATURE_HEADER};

pub const HEALTH_PATH: &str = "/orbitkv/v1/health";
pub const HANDSHAKE_PATH: &str = "/orbitkv/v1/handshake";
pub const CANCEL_PATH: &str = "/orbitkv/v1/cancel";

/// Longest reply read back (error bodies are small).
const MAX_REPLY: u64 = 64 << 10;

/// The first pause before a `503`-refused handshake is sent again; it
/// doubles up to [`RETRY_MAX_PAUSE`].
const RETRY_FIRST_PAUSE: Duration = Duration::from_millis(20);
const RETRY_MAX_PAUSE: Duration = Duration::from_millis(500);

/// [`post`], again after a growing pause while the answer is `503` (the
/// side channel's connection gate or parking budget was full: nothing was
/// admitted, so the same body may go again), until `until`. Returns the last
/// answer.
pub fn post_while_busy(
    addr: &str,
    path: &str,
    body: &str,
    key: Option<&[u8]>,
    timeout: Duration,
    until: Instant,
) -> std::io::Result<(u16, String)> {
    let mut pause = RETRY_FIRST_PAUSE;
    loop {
        let answer = post(addr, path, body, key, timeout);
        if !matches!(answer, Ok((503, _))) || Instant::now() + pause >= until {
            return answer;
        }
        tracing::debug!(%addr, path, "answered 503: trying again in {pause:?}");
        std::thread::sleep(pause);
        pause = (pause * 2).min(RETRY_MAX_PAUSE);
    }
}

/// One HTTP/1.1 POST (`Connection: close`), signed with `key` when given.
/// Returns the status and the reply body. The one side-channel client: the
/// publisher's threads use it, and Python's `orbitkv.vllm.side_channel`
/// (through the binding's `side_channel_post`).
pub fn post(
    addr: &str,
    path: &str,
    body: &str,
    key: Option<&[u8]>,
    timeout: Duration,
) -> std::io::Result<(u16, String)> {
    let sock = addr.to_socket_addrs()?.next().ok_or_else(|| {
        std::io::Error::new(std::io::ErrorKind::InvalidInput, format!("no address for {addr}"))
    })?;
    let mut s = TcpStream::connect_timeout(&sock, timeout)?;
    s.set_read_timeout(Some(timeout))?;
    s.set_write_timeout(Some(timeout))?;
    s.set_nodelay(true)?;
    let mut head = format!(
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n",
        body.len()
    );
    if let Some(k) = key {
        head.push_str(&format!("{SIGNATURE_HEADER}: {}\r\n", sign(k, body.as_bytes())));
    }
    head.push_str("\r\n");
    s.write_all(head.as_bytes())?;
    s.write_all(body.as_bytes())?;
    let mut reply = Vec::new();
    s.take(MAX_REPLY).read_to_end(&mut reply)?;
    let text = String::from_utf8_lossy(&reply);
    let status = text
        .strip_prefix("HTTP/1.1 ")
        .or_else(|| text.strip_prefix("HTTP/1.0 "))
        .and_then(|r| r.get(..3))
        .and_then(|c| c.parse::<u16>().ok())
        .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::InvalidData, "not an HTTP reply"))?;
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    Ok((status, body))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    /// A server that answers each connection with the next status of
    /// `answers` (then closes); returns its address and how many it served.
    fn server(answers: Vec<u16>) -> (String, std::thread::JoinHandle<usize>) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let t = std::thread::spawn(move || {
            let mut served = 0;
            for status in answers {
                let (mut s, _) = l.accept().unwrap();
                let reply =
                    format!("HTTP/1.1 {status} X\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{{}}");
                s.write_all(reply.as_bytes()).unwrap();
                // As the real server's refusal does: close the write half,
                // then drain what the client sent. Closing with its request
                // unread would reset the connection, and the client could
                // lose the reply (a CI failure of this test).
                s.shutdown(std::net::Shutdown::Write).unwrap();
                let mut sink = [0u8; 4096];
                while s.read(&mut sink).map(|n| n > 0).unwrap_or(false) {}
                served += 1;
            }
            served
        });
        (addr, t)
    }

    #[test]
    fn a_busy_answer_is_tried_again_until_it_is_not_or_the_deadline() {
        let t = Duration::from_secs(2);
        // Busy twice, then admitted: the third answer is the one returned.
        let (addr, srv) = server(vec![503, 503, 200]);
        let until = Instant::now() + Duration::from_secs(10);
        let got = post_while_busy(&addr, HANDSHAKE_PATH, "{}", None, t, until).unwrap();
        assert_eq!(got.0, 200);
        assert_eq!(srv.join().unwrap(), 3);
        // Any other refusal is final at once.
        let (addr, srv) = server(vec![403]);
        let got = post_while_busy(&addr, HANDSHAKE_PATH, "{}", None, t, until).unwrap();
        assert_eq!(got.0, 403);
        assert_eq!(srv.join().unwrap(), 1);
        // Busy past the deadline: the last 503 is returned, no later try.
        let (addr, srv) = server(vec![503]);
        let got = post_while_busy(&addr, HANDSHAKE_PATH, "{}", None, t, Instant::now()).unwrap();
        assert_eq!(got.0, 503);
        assert_eq!(srv.join().unwrap(), 1);
    }
}
