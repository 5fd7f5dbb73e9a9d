//! `husk-testsrv PORT`: a small HTTP and WebSocket server for the tests of
//! the daemon's front door, run inside a sandbox (not in the root file
//! system: a test uploads it). One thread per connection, one request per
//! connection (`Connection: close`):
//!
//!   GET  /hello   200, `hello from HOSTNAME` and the request's Host,
//!                 X-Forwarded-For, X-Forwarded-Host and X-Forwarded-Proto
//!   GET  /stream  200, chunked: `tick 0`..`tick 2`, 300 ms apart
//!   POST /echo    200, the request body back (Content-Length or chunked)
//!   GET  /ws      a WebSocket (RFC 6455) that echoes each text or binary
//!                 message and answers a close
//!
//! std only, with its own SHA-1 and base64 (the handshake's accept key).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Duration;

fn main() {
    let port: u16 = match std::env::args().nth(1).and_then(|p| p.parse().ok()) {
        Some(p) => p,
        None => {
            eprintln!("usage: husk-testsrv PORT");
            std::process::exit(2);
        }
    };
    let listener = match TcpListener::bind(("0.0.0.0", port)) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("husk-testsrv: cannot listen on {port}: {e}");
            std::process::exit(1);
        }
    };
    println!("listening on {port}");
    let _ = std::io::stdout().flush();
    for conn in listener.incoming().flatten() {
        std::thread::spawn(move || {
            if let Err(e) = serve(conn) {
                eprintln!("husk-testsrv: {e}");
            }
        });
    }
}

struct Request {
    method: String,
    path: String,
    headers: Vec<(String, String)>,
}

impl Request {
    fn header(&self, name: &str) -> &str {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map_or("", |(_, v)| v.as_str())
    }
}

fn serve(conn: TcpStream) -> std::io::Result<()> {
    conn.set_read_timeout(Some(Duration::from_secs(120)))?;
    let mut out = conn.try_clone()?;
    let mut input = BufReader::new(conn);
    let req = read_head(&mut input)?;
    match (req.method.as_str(), req.path.as_str()) {
        ("GET", "/hello") => {
            let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
            let body = format!(
                "hello from {} host={} forwarded-for={} forwarded-host={} forwarded-proto={}\n",
                host.trim(),
                req.header("host"),
                req.header("x-forwarded-for"),
                req.header("x-forwarded-host"),
                req.header("x-forwarded-proto"),
            );
            respond(&mut out, "200 OK", body.as_bytes())
        }
        ("GET", "/stream") => {
            out.write_all(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\
                  Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n",
            )?;
            for i in 0..3 {
                let chunk = format!("tick {i}\n");
                write!(out, "{:x}\r\n{chunk}\r\n", chunk.len())?;
                out.flush()?;
                std::thread::sleep(Duration::from_millis(300));
            }
            out.write_all(b"0\r\n\r\n")
        }
        ("POST", "/echo") => {
            let body = read_body(&mut input, &req)?;
            respond(&mut out, "200 OK", &body)
        }
        ("GET", "/ws") if req.header("upgrade").eq_ignore_ascii_case("websocket") => {
            let key = req.header("sec-websocket-key").trim().to_owned();
            let accept = base64(&sha1(
                format!("{key}258EAFA5-E914-47DA-95CA-C5AB0DC85B11").as_bytes(),
            ));
            write!(
                out,
                "HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n\
                 Connection: Upgrade\r\nSec-WebSocket-Accept: {accept}\r\n\r\n"
            )?;
            websocket_echo(&mut input, &mut out)
        }
        _ => respond(&mut out, "404 Not Found", b"no such path\n"),
    }
}

fn read_head(input: &mut impl BufRead) -> std::io::Result<Request> {
    let mut line = String::new();
    input.read_line(&mut line)?;
    let mut parts = line.split_whitespace();
    let (method, path) = (
        parts.next().unwrap_or_default().to_owned(),
        parts.next().unwrap_or_default().to_owned(),
    );
    let mut headers = Vec::new();
    loop {
        line.clear();
        if input.read_line(&mut line)? == 0 || line.trim_end().is_empty() {
            break;
        }
        if let Some((k, v)) = line.split_once(':') {
            headers.push((k.trim().to_owned(), v.trim().to_owned()));
        }
    }
    Ok(Request {
        method,
        path,
        headers,
    })
}

fn read_body(input: &mut impl BufRead, req: &Request) -> std::io::Result<Vec<u8>> {
    let mut body = Vec::new();
    if req
        .header("transfer-encoding")
        .eq_ignore_ascii_case("chunked")
    {
        let mut line = String::new();
        loop {
            line.clear();
            input.read_line(&mut line)?;
            let size = usize::from_str_radix(line.trim().split(';').next().unwrap_or(""), 16)
                .map_err(|_| std::io::Error::other("bad chunk size"))?;
            if size == 0 {
                // The trailer section, up to its empty line.
                while input.read_line(&mut line)? > 0 && !line.trim().is_empty() {
                    line.clear();
                }
                return Ok(body);
            }
            let start = body.len();
            body.resize(start + size, 0);
            input.read_exact(&mut body[start..])?;
            input.read_line(&mut line)?; // the chunk's CRLF
        }
    }
    let len: usize = req.header("content-length").parse().unwrap_or(0);
    body.resize(len, 0);
    input.read_exact(&mut body)?;
    Ok(body)
}

fn respond(out: &mut impl Write, status: &str, body: &[u8]) -> std::io::Result<()> {
    write!(
        out,
        "HTTP/1.1 {status}\r\nContent-Type: text/plain\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n",
        body.len()
    )?;
    out.write_all(body)
}

/// Echoes frames until the client closes (or the connection ends).
fn websocket_echo(input: &mut impl Read, out: &mut impl Write) -> std::io::Result<()> {
    loop {
        let mut head = [0u8; 2];
        input.read_exact(&mut head)?;
        let opcode = head[0] & 0x0f;
        let mut len = u64::from(head[1] & 0x7f);
        if len == 126 {
            let mut b = [0u8; 2];
            input.read_exact(&mut b)?;
            len = u64::from(u16::from_be_bytes(b));
        } else if len == 127 {
            let mut b = [0u8; 8];
            input.read_exact(&mut b)?;
            len = u64::from_be_bytes(b);
        }
        if len > 1 << 20 {
            return Err(std::io::Error::other("frame over 1 MiB"));
        }
        let mut mask = [0u8; 4];
        if head[1] & 0x80 != 0 {
            input.read_exact(&mut mask)?;
        }
        let mut payload = vec![0u8; len as usize];
        input.read_exact(&mut payload)?;
        for (i, b) in payload.iter_mut().enumerate() {
            *b ^= mask[i % 4];
        }
        // Server frames are never masked; a close is answered in kind.
        let mut frame = vec![0x80 | opcode];
        match payload.len() {
            n @ 0..=125 => frame.push(n as u8),
            n @ 126..=0xffff => {
                frame.push(126);
                frame.extend_from_slice(&(n as u16).to_be_bytes());
            }
            n => {
                frame.push(127);
                frame.extend_from_slice(&(n as u64).to_be_bytes());
            }
        }
        frame.extend_from_slice(&payload);
        out.write_all(&frame)?;
        if opcode == 0x8 {
            return Ok(());
        }
    }
}

fn sha1(data: &[u8]) -> [u8; 20] {
    let mut h: [u32; 5] = [0x67452301, 0xEFCDAB89, 0x98BADCFE, 0x10325476, 0xC3D2E1F0];
    let mut msg = data.to_vec();
    msg.push(0x80);
    while msg.len() % 64 != 56 {
        msg.push(0);
    }
    msg.extend_from_slice(&((data.len() as u64) * 8).to_be_bytes());
    for block in msg.chunks(64) {
        let mut w = [0u32; 80];
        for (i, word) in block.chunks(4).enumerate() {
            w[i] = u32::from_be_bytes([word[0], word[1], word[2], word[3]]);
        }
        for i in 16..80 {
            w[i] = (w[i - 3] ^ w[i - 8] ^ w[i - 14] ^ w[i - 16]).rotate_left(1);
        }
        let [mut a, mut b, mut c, mut d, mut e] = h;
        for (i, wi) in w.iter().enumerate() {
            let (f, k) = match i {
                0..=19 => ((b & c) | (!b & d), 0x5A827999),
                20..=39 => (b ^ c ^ d, 0x6ED9EBA1),
                40..=59 => ((b & c) | (b & d) | (c & d), 0x8F1BBCDC),
                _ => (b ^ c ^ d, 0xCA62C1D6),
            };
            let t = a
                .rotate_left(5)
                .wrapping_add(f)
                .wrapping_add(e)
                .wrapping_add(k)
                .wrapping_add(*wi);
            (e, d, c, b, a) = (d, c, b.rotate_left(30), a, t);
        }
        for (x, y) in h.iter_mut().zip([a, b, c, d, e]) {
            *x = x.wrapping_add(y);
        }
    }
    let mut out = [0u8; 20];
    for (i, x) in h.iter().enumerate() {
        out[i * 4..i * 4 + 4].copy_from_slice(&x.to_be_bytes());
    }
    out
}

fn base64(data: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for chunk in data.chunks(3) {
        let n = chunk.iter().fold(0u32, |n, b| n << 8 | u32::from(*b)) << (8 * (3 - chunk.len()));
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(ALPHABET[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_accept_key_is_rfc_6455s() {
        // RFC 6455 section 1.3's example.
        let key = "dGhlIHNhbXBsZSBub25jZQ==258EAFA5-E914-47DA-95CA-C5AB0DC85B11";
        assert_eq!(
            super::base64(&super::sha1(key.as_bytes())),
            "s3pPLMBiTxaQ9kYGzzhZRbK+xOo="
        );
    }
}
