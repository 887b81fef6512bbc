//! [`Server`]: `GET /metrics` over HTTP/1.1 on a std thread of its own, independent of the
//! engine's runtime (and of an embedder's). One connection at a time, each read with a
//! deadline ([`READ_DEADLINE`]) and closed after its answer; anything but `GET /metrics` gets
//! 404. The answer is OpenMetrics when the `Accept` header asks for it (Prometheus does),
//! else text format 0.0.4.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use super::Metrics;

/// How long a scrape may take to send its request (and to read the answer).
pub const READ_DEADLINE: Duration = Duration::from_secs(5);

/// A request's head at most.
const MAX_HEAD: usize = 8 << 10;

/// The metrics endpoint; serves until dropped.
#[derive(Debug)]
pub struct Server {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Server {
    /// Binds `addr` (`HOST:PORT`; port 0 picks a free one) and serves `metrics` there.
    pub fn bind(addr: &str, metrics: Arc<Metrics>) -> std::io::Result<Self> {
        let listener = TcpListener::bind(addr)?;
        let addr = listener.local_addr()?;
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name("kvrelay-metrics".into())
            .spawn(move || {
                for conn in listener.incoming() {
                    if flag.load(Ordering::Acquire) {
                        break;
                    }
                    if let Ok(s) = conn {
                        // A scrape that fails (the peer left, a timeout) ends its connection only.
                        let _ = answer(s, &metrics);
                    }
                }
            })?;
        Ok(Self {
            addr,
            stop,
            thread: Some(thread),
        })
    }

    /// The address bound (the port chosen, for port 0).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        // Wakes the accept; if the connection fails the listener is gone already.
        let _ = TcpStream::connect_timeout(&self.addr, READ_DEADLINE);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Reads one request head and answers it.
fn answer(mut s: TcpStream, metrics: &Metrics) -> std::io::Result<()> {
    s.set_read_timeout(Some(READ_DEADLINE))?;
    s.set_write_timeout(Some(READ_DEADLINE))?;
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = s.read(&mut buf)?;
        if n == 0 || head.len() + n > MAX_HEAD {
            return Ok(());
        }
        head.extend_from_slice(&buf[..n]);
    }
    let head = String::from_utf8_lossy(&head);
    let mut lines = head.split("\r\n");
    let request = lines.next().unwrap_or_default();
    let mut parts = request.split(' ');
    let (method, path) = (parts.next(), parts.next());
    let path = path.map(|p| p.split('?').next().unwrap_or(p));
    if method != Some("GET") || path != Some("/metrics") {
        let body = "not found: GET /metrics\n";
        return respond(&mut s, "404 Not Found", "text/plain; charset=utf-8", body);
    }
    let openmetrics = lines.any(|l| {
        let l = l.to_ascii_lowercase();
        l.starts_with("accept:") && l.contains("application/openmetrics-text")
    });
    let (body, content_type) = metrics.encode(openmetrics);
    respond(&mut s, "200 OK", content_type, &body)
}

fn respond(s: &mut TcpStream, status: &str, content_type: &str, body: &str) -> std::io::Result<()> {
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes())?;
    s.write_all(body.as_bytes())?;
    s.flush()
}
