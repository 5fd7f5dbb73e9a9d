//! The host side of virtio-vsock: guest stream connections bridged to Unix
//! sockets, with the protocol Firecracker users know.
//!
//! * Host to guest: a program connects to the VMM's socket at `uds_path` and
//!   writes `CONNECT <port>\n`; once the guest accepts, it reads
//!   `OK <host port>\n` and the stream carries the connection.
//! * Guest to host: a guest connecting to host port P reaches the Unix
//!   socket `<uds_path>_<P>` if a program listens there; otherwise the guest
//!   gets a reset.
//!
//! Flow control is the spec's credit scheme (5.10.6.3): each side advertises
//! its buffer (`buf_alloc`) and how much it has consumed (`fwd_cnt`), and a
//! sender never has more than that in flight. Data from the host is read
//! from a Unix socket only when the guest has credit for it, so a fast host
//! program cannot make the VMM buffer without bound; data from the guest that
//! the host program is slow to take is held up to our advertised buffer and
//! a guest exceeding it is reset.
//!
//! Everything a guest can make the muxer hold is bounded: connections it
//! opens ([`MAX_GUEST_CONNS`], apart from the host's own
//! [`MAX_HOST_CONNS`], so a guest cannot crowd out the host's agent
//! connections), packets queued for it ([`MAX_CONTROL`]) and bytes held per
//! connection ([`CONN_BUF`]). What is refused or dropped is counted.

use std::collections::{HashMap, VecDeque};
use std::io::{ErrorKind, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use event_manager::{EventOps, EventSet, Events};

use super::packet::*;
use crate::timeline::{Phase, Timeline};

/// Buffer space we advertise to the guest per connection.
pub const CONN_BUF: u32 = 256 << 10;
/// Longest `CONNECT <port>\n` line accepted from a host program.
const MAX_CONNECT_LINE: usize = 32;
/// Event token of the listener; connection tokens start above the queues'.
pub const TOKEN_LISTENER: u32 = 3;
const FIRST_STREAM_TOKEN: u32 = 16;
/// Host-side ports for host-initiated connections, as Firecracker allocates:
/// `LOCAL_PORT_BASE` and up, from a random start (see [`random_port_start`]).
const LOCAL_PORT_BASE: u32 = 1 << 30;
/// Connections the guest may have open to host ports at once; more are reset.
pub const MAX_GUEST_CONNS: usize = 128;
/// Connections host programs may have open or opening at once; more are
/// refused with an `ERROR` line.
pub const MAX_HOST_CONNS: usize = 128;
/// Payload-less packets queued for a guest that does not take them; past
/// this, resets for unknown connections and credit packets are dropped (the
/// guest asks again) and new connections are refused.
pub const MAX_CONTROL: usize = 4 * (MAX_GUEST_CONNS + MAX_HOST_CONNS);

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct ConnKey {
    local_port: u32,
    peer_port: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ConnState {
    /// A host program connected; we sent REQUEST and wait for RESPONSE.
    LocalInit,
    Established,
}

#[derive(Debug)]
struct Conn {
    stream: UnixStream,
    token: u32,
    state: ConnState,
    /// Guest data the host program has not taken yet.
    tx_buf: VecDeque<u8>,
    /// Bytes of guest data passed to the host program (our fwd_cnt).
    fwd_cnt: u32,
    /// The fwd_cnt the guest last heard from us.
    fwd_cnt_sent: u32,
    /// Bytes of host data sent to the guest.
    rx_cnt: u32,
    peer_buf_alloc: u32,
    peer_fwd_cnt: u32,
    /// The guest will send no more data.
    peer_send_closed: bool,
    /// The guest will take no more data.
    peer_rcv_closed: bool,
    /// Events currently watched on the stream.
    watched: EventSet,
    /// Queued in `rx_ready`.
    rx_queued: bool,
}

impl Conn {
    /// How many more bytes the guest can take from us.
    fn peer_free(&self) -> u32 {
        self.peer_buf_alloc
            .saturating_sub(self.rx_cnt.wrapping_sub(self.peer_fwd_cnt))
    }
}

#[derive(Debug)]
struct PendingStream {
    stream: UnixStream,
    line: Vec<u8>,
}

/// What the muxer refused or dropped, for logs and tests.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Refusals {
    /// Guest connections reset because the guest had too many open.
    pub guest_conns: u64,
    /// Host connections refused because too many were open.
    pub host_conns: u64,
    /// Control packets dropped because the guest was not taking them.
    pub control: u64,
    /// Times accepting a host connection failed (e.g. out of descriptors).
    pub accept_errors: u64,
}

/// All vsock connections of one VM.
#[derive(Debug)]
pub struct Muxer {
    guest_cid: u64,
    uds_path: PathBuf,
    /// Device and inode of the socket file we bound: the file is removed at
    /// exit only while it is still ours (not replaced by another VMM).
    uds_ino: (u64, u64),
    listener: UnixListener,
    pending: HashMap<u32, PendingStream>,
    conns: HashMap<ConnKey, Conn>,
    tokens: HashMap<u32, ConnKey>,
    next_token: u32,
    next_local_port: u32,
    /// Packets without payload for the guest (RESPONSE, RST, CREDIT_UPDATE...).
    control: VecDeque<Header>,
    /// Connections with host data (or an EOF) to forward to the guest.
    rx_ready: VecDeque<ConnKey>,
    /// Host-initiated connections open (counted in `conns`).
    host_conns: usize,
    /// The listener is unwatched after an accept error (out of descriptors)
    /// until a connection closes, so the event loop does not spin on it.
    listener_paused: bool,
    refusals: Refusals,
    /// Where the first accepted connection and first reply are marked.
    timeline: Option<Arc<Timeline>>,
}

/// Errors setting up the host side.
#[derive(Debug, thiserror::Error)]
pub enum MuxerError {
    #[error("cannot listen on the vsock socket {0}: {1}")]
    Listen(PathBuf, #[source] std::io::Error),
    #[error("cannot create a queue eventfd: {0}")]
    EventFd(#[source] std::io::Error),
}

impl Muxer {
    /// Listens on `uds_path` (replacing a stale socket file there).
    pub fn new(guest_cid: u64, uds_path: &Path) -> Result<Self, MuxerError> {
        let listen = |e| MuxerError::Listen(uds_path.to_owned(), e);
        match std::fs::remove_file(uds_path) {
            Err(e) if e.kind() != ErrorKind::NotFound => return Err(listen(e)),
            _ => {}
        }
        let listener = UnixListener::bind(uds_path).map_err(listen)?;
        listener.set_nonblocking(true).map_err(listen)?;
        let uds_ino = file_id(uds_path).map_err(listen)?;
        Ok(Muxer {
            guest_cid,
            uds_path: uds_path.to_owned(),
            uds_ino,
            listener,
            pending: HashMap::new(),
            conns: HashMap::new(),
            tokens: HashMap::new(),
            next_token: FIRST_STREAM_TOKEN,
            next_local_port: random_port_start(),
            control: VecDeque::new(),
            rx_ready: VecDeque::new(),
            host_conns: 0,
            listener_paused: false,
            refusals: Refusals::default(),
            timeline: None,
        })
    }

    /// Marks the first accepted connection and first reply on `timeline`.
    pub fn set_timeline(&mut self, timeline: Arc<Timeline>) {
        self.timeline = Some(timeline);
    }

    fn mark(&self, phase: Phase) {
        if let Some(timeline) = &self.timeline {
            timeline.mark(phase);
        }
    }

    /// Removes the socket file, if it is still the one this muxer bound.
    /// Called once the VM has ended; the listener itself closes with the
    /// process.
    pub fn remove_socket_file(&self) {
        if file_id(&self.uds_path).is_ok_and(|id| id == self.uds_ino) {
            let _ = std::fs::remove_file(&self.uds_path);
        }
    }

    /// Watches the listener.
    pub fn init(&mut self, ops: &mut EventOps) {
        let events = Events::with_data(&self.listener, TOKEN_LISTENER, EventSet::IN);
        if let Err(e) = ops.add(events) {
            tracing::error!("vsock: cannot watch the listener: {e:?}");
        }
    }

    /// Whether a packet for the guest is waiting.
    pub fn has_rx(&self) -> bool {
        !self.control.is_empty() || !self.rx_ready.is_empty()
    }

    /// Number of open connections (for tests and metrics).
    pub fn connection_count(&self) -> usize {
        self.conns.len()
    }

    /// What has been refused or dropped so far.
    pub fn refusals(&self) -> Refusals {
        self.refusals
    }

    fn control_full(&self) -> bool {
        self.control.len() >= MAX_CONTROL
    }

    /// Queues a control packet; drops it (counted) when the guest is not
    /// taking them. Dropping is safe: a lost reset or credit update is
    /// asked for again by the guest, and callers that open connections
    /// check [`Self::control_full`] first.
    fn push_control(&mut self, h: Header) {
        if self.control_full() {
            self.refusals.control += 1;
            if self.refusals.control == 1 {
                tracing::warn!("vsock: the guest is not taking packets; dropping control packets");
            }
            return;
        }
        self.control.push_back(h);
    }

    fn header(&self, key: ConnKey, op: u16) -> Header {
        let fwd_cnt = self.conns.get(&key).map_or(0, |c| c.fwd_cnt);
        Header {
            src_cid: HOST_CID,
            dst_cid: self.guest_cid,
            src_port: key.local_port,
            dst_port: key.peer_port,
            len: 0,
            type_: TYPE_STREAM,
            op,
            flags: 0,
            buf_alloc: CONN_BUF,
            fwd_cnt,
        }
    }

    fn send_control(&mut self, key: ConnKey, op: u16) {
        let h = self.header(key, op);
        if let Some(c) = self.conns.get_mut(&key) {
            c.fwd_cnt_sent = c.fwd_cnt;
        }
        self.push_control(h);
    }

    /// A reset for a packet that matches no connection.
    fn reset_reply(&mut self, h: &Header) {
        if h.op == OP_RST {
            return;
        }
        self.push_control(Header {
            src_cid: HOST_CID,
            dst_cid: self.guest_cid,
            src_port: h.dst_port,
            dst_port: h.src_port,
            type_: TYPE_STREAM,
            op: OP_RST,
            ..Default::default()
        });
    }

    fn watch(&mut self, key: ConnKey, want: EventSet, ops: &mut EventOps) {
        let Some(conn) = self.conns.get_mut(&key) else {
            return;
        };
        if conn.watched == want {
            return;
        }
        let fd = conn.stream.as_raw_fd();
        let result = match (conn.watched.is_empty(), want.is_empty()) {
            (true, false) => ops.add(Events::with_data_raw(fd, conn.token, want)),
            (false, true) => ops.remove(Events::with_data_raw(fd, conn.token, conn.watched)),
            _ => ops.modify(Events::with_data_raw(fd, conn.token, want)),
        };
        if let Err(e) = result {
            tracing::warn!("vsock: cannot change the events of a connection: {e:?}");
        }
        conn.watched = want;
    }

    /// Closes a connection and forgets it; `rst` tells the guest.
    fn close(&mut self, key: ConnKey, rst: bool, ops: &mut EventOps) {
        self.watch(key, EventSet::empty(), ops);
        if rst {
            self.send_control(key, OP_RST);
        }
        if let Some(conn) = self.conns.remove(&key) {
            self.tokens.remove(&conn.token);
            if is_host_port(key.local_port) {
                self.host_conns -= 1;
            }
        }
        self.rx_ready.retain(|k| *k != key);
        self.resume_listener(ops);
    }

    /// Watches the listener again after an accept error, now that a
    /// descriptor may be free.
    fn resume_listener(&mut self, ops: &mut EventOps) {
        if !self.listener_paused {
            return;
        }
        let events = Events::with_data(&self.listener, TOKEN_LISTENER, EventSet::IN);
        if ops.add(events).is_ok() {
            self.listener_paused = false;
        }
    }

    fn add_conn(
        &mut self,
        key: ConnKey,
        stream: UnixStream,
        state: ConnState,
        peer: &Header,
    ) -> u32 {
        let token = self.next_token;
        self.next_token = self.next_token.wrapping_add(1).max(FIRST_STREAM_TOKEN);
        self.tokens.insert(token, key);
        if is_host_port(key.local_port) {
            self.host_conns += 1;
        }
        self.conns.insert(
            key,
            Conn {
                stream,
                token,
                state,
                tx_buf: VecDeque::new(),
                fwd_cnt: 0,
                fwd_cnt_sent: 0,
                rx_cnt: 0,
                peer_buf_alloc: peer.buf_alloc,
                peer_fwd_cnt: peer.fwd_cnt,
                peer_send_closed: false,
                peer_rcv_closed: false,
                watched: EventSet::empty(),
                rx_queued: false,
            },
        );
        token
    }

    /// Handles an event on the listener or a stream.
    pub fn on_event(&mut self, token: u32, set: EventSet, ops: &mut EventOps) {
        if token == TOKEN_LISTENER {
            self.accept(ops);
        } else if self.pending.contains_key(&token) {
            self.read_connect_line(token, ops);
        } else if let Some(&key) = self.tokens.get(&token) {
            let waiting = self
                .conns
                .get(&key)
                .is_some_and(|c| c.state == ConnState::LocalInit);
            if waiting {
                // The host program left before the guest answered.
                if set.intersects(EventSet::HANG_UP | EventSet::READ_HANG_UP) {
                    self.close(key, true, ops);
                }
                return;
            }
            if set.intersects(EventSet::OUT) {
                self.flush_tx(key, ops);
            }
            if set.intersects(EventSet::IN | EventSet::HANG_UP | EventSet::READ_HANG_UP) {
                self.queue_rx(key, ops);
            }
        }
    }

    fn accept(&mut self, ops: &mut EventOps) {
        loop {
            match self.listener.accept() {
                Ok((mut stream, _)) => {
                    if self.host_conns + self.pending.len() >= MAX_HOST_CONNS || self.control_full()
                    {
                        self.refusals.host_conns += 1;
                        let _ = stream.set_nonblocking(true);
                        let _ = stream.write_all(b"ERROR too many connections\n");
                        continue;
                    }
                    if stream.set_nonblocking(true).is_err() {
                        continue;
                    }
                    let token = self.next_token;
                    self.next_token = self.next_token.wrapping_add(1).max(FIRST_STREAM_TOKEN);
                    if ops
                        .add(Events::with_data(&stream, token, EventSet::IN))
                        .is_ok()
                    {
                        self.pending.insert(
                            token,
                            PendingStream {
                                stream,
                                line: Vec::new(),
                            },
                        );
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => {
                    // Out of descriptors or memory: the connection stays in
                    // the backlog, so the listener stays readable. Stop
                    // watching it until a connection closes, or the event
                    // loop would spin (and log) on it.
                    self.refusals.accept_errors += 1;
                    tracing::warn!(
                        "vsock: accept on {} failed: {e}; waiting for a connection to close",
                        self.uds_path.display()
                    );
                    let events = Events::with_data(&self.listener, TOKEN_LISTENER, EventSet::IN);
                    if ops.remove(events).is_ok() {
                        self.listener_paused = true;
                    }
                    return;
                }
            }
        }
    }

    /// Reads `CONNECT <port>\n` from a new host connection.
    fn read_connect_line(&mut self, token: u32, ops: &mut EventOps) {
        let Some(p) = self.pending.get_mut(&token) else {
            return;
        };
        let mut byte = [0u8; 1];
        let port = loop {
            match p.stream.read(&mut byte) {
                Ok(1) if byte[0] == b'\n' => break parse_connect(&p.line),
                Ok(1) if p.line.len() < MAX_CONNECT_LINE => p.line.push(byte[0]),
                Ok(_) => break None, // EOF or an over-long line
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(_) => break None,
            }
        };
        let Some(p) = self.pending.remove(&token) else {
            return;
        };
        let _ = ops.remove(Events::with_data(&p.stream, token, EventSet::IN));
        let Some(peer_port) = port else {
            let mut stream = p.stream;
            let _ = stream.write_all(b"ERROR expected CONNECT <port>\n");
            drop(stream);
            self.resume_listener(ops);
            return;
        };
        let key = loop {
            self.next_local_port = self.next_local_port.wrapping_add(1);
            let key = ConnKey {
                local_port: (self.next_local_port & !LOCAL_PORT_BASE) | LOCAL_PORT_BASE,
                peer_port,
            };
            // At most MAX_HOST_CONNS ports are taken: this ends at once.
            if !self.conns.contains_key(&key) {
                break key;
            }
        };
        let no_credit_yet = Header::default();
        // Nothing is read from the stream until the guest accepts, but a
        // host program that gives up waiting is noticed: a guest that never
        // answers must not keep host sockets open.
        self.add_conn(key, p.stream, ConnState::LocalInit, &no_credit_yet);
        self.watch(key, EventSet::READ_HANG_UP, ops);
        self.send_control(key, OP_REQUEST);
    }

    /// Handles a packet the guest sent.
    pub fn on_guest_packet(&mut self, h: &Header, payload: &[u8], ops: &mut EventOps) {
        if h.src_cid != self.guest_cid || h.dst_cid != HOST_CID {
            // A clone's guest does this until it handles the transport
            // reset and learns its new CID: not worth a warning.
            tracing::debug!(
                "vsock: dropping a packet from cid {} to cid {}",
                h.src_cid,
                h.dst_cid
            );
            return;
        }
        if h.type_ != TYPE_STREAM {
            self.reset_reply(h);
            return;
        }
        let key = ConnKey {
            local_port: h.dst_port,
            peer_port: h.src_port,
        };
        if h.op == OP_REQUEST {
            self.connect_to_host(key, h, ops);
            return;
        }
        let Some(conn) = self.conns.get_mut(&key) else {
            self.reset_reply(h);
            return;
        };
        conn.peer_buf_alloc = h.buf_alloc;
        conn.peer_fwd_cnt = h.fwd_cnt;
        match (h.op, conn.state) {
            (OP_RESPONSE, ConnState::LocalInit) => {
                conn.state = ConnState::Established;
                if let Some(timeline) = &self.timeline {
                    timeline.mark(Phase::VsockConnected);
                }
                let reply = format!("OK {}\n", key.local_port);
                if conn.stream.write_all(reply.as_bytes()).is_err() {
                    self.close(key, true, ops);
                    return;
                }
                self.watch(key, EventSet::IN | EventSet::READ_HANG_UP, ops);
            }
            (OP_RW, ConnState::Established) => {
                self.mark(Phase::VsockFirstReply);
                self.take_guest_data(key, payload, ops);
            }
            (OP_CREDIT_UPDATE, ConnState::Established) => self.resume_rx(key, ops),
            (OP_CREDIT_REQUEST, ConnState::Established) => self.send_control(key, OP_CREDIT_UPDATE),
            (OP_SHUTDOWN, ConnState::Established) => self.peer_shutdown(key, h.flags, ops),
            (OP_RST, ConnState::LocalInit) => {
                // Say why, rather than end the stream without a word.
                let reply = format!(
                    "ERROR the guest refused the connection to port {}\n",
                    key.peer_port
                );
                let _ = conn.stream.write_all(reply.as_bytes());
                self.close(key, false, ops);
            }
            (OP_RST, _) => self.close(key, false, ops),
            (op, state) => {
                tracing::debug!("vsock: unexpected op {op} in state {state:?}; resetting");
                self.close(key, true, ops);
            }
        }
    }

    fn connect_to_host(&mut self, key: ConnKey, h: &Header, ops: &mut EventOps) {
        if self.conns.contains_key(&key) {
            self.close(key, true, ops);
            return;
        }
        if is_host_port(key.local_port) {
            // Host ports in this range are ours, for host-initiated
            // connections; a guest cannot connect to them.
            self.reset_reply(h);
            return;
        }
        if self.conns.len() - self.host_conns >= MAX_GUEST_CONNS || self.control_full() {
            self.refusals.guest_conns += 1;
            if self.refusals.guest_conns == 1 {
                tracing::warn!(
                    "vsock: the guest has {MAX_GUEST_CONNS} connections open; resetting new ones"
                );
            }
            self.reset_reply(h);
            return;
        }
        let path = format!("{}_{}", self.uds_path.display(), key.local_port);
        let stream = match UnixStream::connect(&path) {
            Ok(s) if s.set_nonblocking(true).is_ok() => s,
            _ => {
                self.reset_reply(h);
                return;
            }
        };
        self.add_conn(key, stream, ConnState::Established, h);
        self.watch(key, EventSet::IN | EventSet::READ_HANG_UP, ops);
        self.send_control(key, OP_RESPONSE);
    }

    fn take_guest_data(&mut self, key: ConnKey, payload: &[u8], ops: &mut EventOps) {
        let Some(conn) = self.conns.get_mut(&key) else {
            return;
        };
        if conn.tx_buf.len() + payload.len() > CONN_BUF as usize {
            tracing::warn!("vsock: the guest sent more than its credit allows; resetting");
            self.close(key, true, ops);
            return;
        }
        conn.tx_buf.extend(payload);
        self.flush_tx(key, ops);
    }

    /// Writes held guest data to the host program.
    fn flush_tx(&mut self, key: ConnKey, ops: &mut EventOps) {
        let Some(conn) = self.conns.get_mut(&key) else {
            return;
        };
        while !conn.tx_buf.is_empty() {
            let (front, _) = conn.tx_buf.as_slices();
            match conn.stream.write(front) {
                Ok(0) => break,
                Ok(n) => {
                    conn.tx_buf.drain(..n);
                    conn.fwd_cnt = conn.fwd_cnt.wrapping_add(n as u32);
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(_) => {
                    self.close(key, true, ops);
                    return;
                }
            }
        }
        let pending = !conn.tx_buf.is_empty();
        let finished = !pending && conn.peer_send_closed;
        if finished && conn.peer_rcv_closed {
            // Both directions are done: a reset completes the close (5.10.6.6).
            self.close(key, true, ops);
            return;
        }
        // Tell the guest about freed space once a good part of it is free.
        let unannounced = conn.fwd_cnt.wrapping_sub(conn.fwd_cnt_sent);
        let announce = unannounced >= CONN_BUF / 4 || (unannounced > 0 && !pending);
        let mut want = conn.watched & !EventSet::OUT;
        if pending {
            want |= EventSet::OUT;
        }
        if finished {
            let _ = conn.stream.shutdown(std::net::Shutdown::Write);
        }
        if announce {
            self.send_control(key, OP_CREDIT_UPDATE);
        }
        self.watch(key, want, ops);
    }

    fn peer_shutdown(&mut self, key: ConnKey, flags: u32, ops: &mut EventOps) {
        let Some(conn) = self.conns.get_mut(&key) else {
            return;
        };
        conn.peer_send_closed |= flags & SHUTDOWN_SEND != 0;
        conn.peer_rcv_closed |= flags & SHUTDOWN_RCV != 0;
        if conn.peer_rcv_closed {
            // Nothing more goes to the guest.
            let want = conn.watched & !(EventSet::IN | EventSet::READ_HANG_UP);
            self.rx_ready.retain(|k| *k != key);
            self.watch(key, want, ops);
        }
        // Delivers what we hold; closes once both directions are done.
        self.flush_tx(key, ops);
    }

    /// The guest gave us more credit: read from the host program again.
    fn resume_rx(&mut self, key: ConnKey, ops: &mut EventOps) {
        let Some(conn) = self.conns.get(&key) else {
            return;
        };
        if conn.peer_free() > 0 && !conn.watched.contains(EventSet::IN) {
            let want = conn.watched | EventSet::IN;
            self.watch(key, want, ops);
        }
    }

    /// The host program sent data (or closed): queue the connection for RX
    /// and stop watching for input until it has been served, so a guest that
    /// is slow to post buffers does not make the event loop spin.
    fn queue_rx(&mut self, key: ConnKey, ops: &mut EventOps) {
        let Some(conn) = self.conns.get_mut(&key) else {
            return;
        };
        if !conn.rx_queued {
            conn.rx_queued = true;
            self.rx_ready.push_back(key);
        }
        let want = conn.watched & !(EventSet::IN | EventSet::READ_HANG_UP);
        self.watch(key, want, ops);
    }

    /// The next packet for the guest, whose RX buffer takes `capacity`
    /// payload bytes.
    pub fn next_rx(&mut self, capacity: usize, ops: &mut EventOps) -> Option<(Header, Vec<u8>)> {
        if let Some(h) = self.control.pop_front() {
            return Some((h, Vec::new()));
        }
        while let Some(key) = self.rx_ready.pop_front() {
            let Some(conn) = self.conns.get_mut(&key) else {
                continue;
            };
            conn.rx_queued = false;
            if conn.state != ConnState::Established {
                continue;
            }
            if capacity == 0 {
                // This buffer only fits control packets; keep our place.
                conn.rx_queued = true;
                self.rx_ready.push_front(key);
                return None;
            }
            let room = (conn.peer_free() as usize).min(capacity);
            if room == 0 {
                // No credit: ask for some; a CREDIT_UPDATE resumes reading.
                self.send_control(key, OP_CREDIT_REQUEST);
                return self.control.pop_front().map(|h| (h, Vec::new()));
            }
            let mut buf = vec![0u8; room];
            match conn.stream.read(&mut buf) {
                Ok(0) => {
                    // The host program will send no more; it may still read.
                    let want = conn.watched & !(EventSet::IN | EventSet::READ_HANG_UP);
                    self.watch(key, want, ops);
                    let mut h = self.header(key, OP_SHUTDOWN);
                    h.flags = SHUTDOWN_SEND;
                    return Some((h, Vec::new()));
                }
                Ok(n) => {
                    buf.truncate(n);
                    conn.rx_cnt = conn.rx_cnt.wrapping_add(n as u32);
                    conn.fwd_cnt_sent = conn.fwd_cnt;
                    // There may be more: stay in line behind the others.
                    conn.rx_queued = true;
                    self.rx_ready.push_back(key);
                    let mut h = self.header(key, OP_RW);
                    h.len = n as u32;
                    return Some((h, buf));
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    let want = conn.watched | EventSet::IN | EventSet::READ_HANG_UP;
                    self.watch(key, want, ops);
                }
                Err(_) => self.close(key, true, ops),
            }
        }
        self.control.pop_front().map(|h| (h, Vec::new()))
    }

    /// Every connection is gone (device reset or snapshot): close the host
    /// streams; the guest driver resets its side itself.
    pub fn reset(&mut self, ops: &mut EventOps) {
        let keys: Vec<_> = self.conns.keys().copied().collect();
        for key in keys {
            self.close(key, false, ops);
        }
        self.control.clear();
    }
}

/// Where a VMM starts counting the host-side ports of host-initiated
/// connections: at random. A restored guest still holds the sockets of the
/// connections its snapshot's VMM had open (or was closing): the transport
/// reset marks them closed, but they stay in the guest kernel's table until
/// their owner lets go of them or their close timer fires, and a REQUEST
/// for the same port pair meanwhile is answered with a reset. Every clone
/// of a snapshot counting from the same port would step on them; from a
/// random point of 2^30 ports, none does.
fn random_port_start() -> u32 {
    let mut seed = [0u8; 4];
    match crate::getrandom(&mut seed) {
        Ok(()) => u32::from_ne_bytes(seed),
        // Unlikely; the clock and pid still differ between clones.
        Err(_) => {
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.subsec_nanos());
            nanos ^ std::process::id().rotate_left(16)
        }
    }
}

/// Whether a host-side port is one we allocate for host-initiated
/// connections.
fn is_host_port(port: u32) -> bool {
    port & LOCAL_PORT_BASE != 0
}

/// A file's device and inode numbers (not following a symlink).
fn file_id(path: &Path) -> std::io::Result<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::symlink_metadata(path)?;
    Ok((meta.dev(), meta.ino()))
}

fn parse_connect(line: &[u8]) -> Option<u32> {
    let line = std::str::from_utf8(line).ok()?.trim();
    let (word, port) = line.split_once(char::is_whitespace)?;
    if !word.eq_ignore_ascii_case("connect") {
        return None;
    }
    port.trim().parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use event_manager::{EventManager, MutEventSubscriber, SubscriberOps};
    use std::sync::{Arc, Mutex};
    use vmm_sys_util::eventfd::EventFd;

    const GUEST: u64 = 3;

    /// Feeds guest packets to a muxer inside a real event loop and collects
    /// what it would send back to the guest.
    struct Harness {
        muxer: Muxer,
        kick: EventFd,
        input: Vec<Header>,
        output: Vec<Header>,
        /// Whether the "guest" takes packets (posts RX buffers).
        drain: bool,
    }

    impl MutEventSubscriber for Harness {
        fn init(&mut self, ops: &mut EventOps) {
            ops.add(Events::new(&self.kick, EventSet::IN))
                .expect("watch");
            self.muxer.init(ops);
        }
        fn process(&mut self, events: Events, ops: &mut EventOps) {
            if events.fd() == self.kick.as_raw_fd() {
                let _ = self.kick.read();
            } else {
                self.muxer.on_event(events.data(), events.event_set(), ops);
            }
            for h in std::mem::take(&mut self.input) {
                self.muxer.on_guest_packet(&h, &[], ops);
            }
            while self.drain {
                let Some((h, _)) = self.muxer.next_rx(4096, ops) else {
                    break;
                };
                self.output.push(h);
            }
        }
    }

    fn harness(dir: &Path, input: Vec<Header>, drain: bool) -> Arc<Mutex<Harness>> {
        Arc::new(Mutex::new(Harness {
            muxer: Muxer::new(GUEST, &dir.join("v.sock")).expect("muxer"),
            kick: EventFd::new(libc::EFD_NONBLOCK).expect("eventfd"),
            input,
            output: Vec::new(),
            drain,
        }))
    }

    fn exchange(dir: &Path, packets: Vec<Header>) -> (Vec<Header>, usize) {
        let harness = harness(dir, packets, true);
        let mut events = EventManager::<Arc<Mutex<Harness>>>::new().expect("event loop");
        events.add_subscriber(harness.clone());
        harness.lock().expect("lock").kick.write(1).expect("kick");
        events.run_with_timeout(100).expect("run");
        let h = harness.lock().expect("lock");
        (h.output.clone(), h.muxer.connection_count())
    }

    fn from_guest(op: u16) -> Header {
        Header {
            src_cid: GUEST,
            dst_cid: HOST_CID,
            src_port: 1234,
            dst_port: 80,
            type_: TYPE_STREAM,
            op,
            buf_alloc: 4096,
            ..Default::default()
        }
    }

    #[test]
    fn a_host_program_that_gives_up_before_the_guest_answers_is_forgotten() {
        let dir = vmm_sys_util::tempdir::TempDir::new().expect("tempdir");
        let harness = harness(dir.as_path(), Vec::new(), true);
        let mut events = EventManager::<Arc<Mutex<Harness>>>::new().expect("event loop");
        events.add_subscriber(harness.clone());
        let mut host = UnixStream::connect(dir.as_path().join("v.sock")).expect("connect");
        host.write_all(b"CONNECT 1024\n").expect("connect line");
        for _ in 0..3 {
            events.run_with_timeout(50).expect("run");
        }
        let (asked, waiting) = {
            let h = harness.lock().expect("lock");
            (
                h.output.iter().map(|p| p.op).collect::<Vec<_>>(),
                h.muxer.connection_count(),
            )
        };

        // The guest never answers; the host program gives up.
        drop(host);
        for _ in 0..3 {
            events.run_with_timeout(50).expect("run");
        }

        let h = harness.lock().expect("lock");
        assert_eq!(asked, vec![OP_REQUEST]);
        assert_eq!(waiting, 1);
        assert_eq!(
            h.output.last().map(|p| p.op),
            Some(OP_RST),
            "the guest is told"
        );
        assert_eq!(h.muxer.connection_count(), 0);
    }

    #[test]
    fn a_connection_to_a_port_nobody_listens_on_is_reset() {
        let dir = vmm_sys_util::tempdir::TempDir::new().expect("tempdir");

        let (out, conns) = exchange(dir.as_path(), vec![from_guest(OP_REQUEST)]);

        assert_eq!(out.len(), 1);
        assert_eq!(
            (out[0].op, out[0].dst_port, out[0].src_port),
            (OP_RST, 1234, 80)
        );
        assert_eq!(conns, 0);
    }

    #[test]
    fn a_connection_to_a_listening_host_socket_is_accepted() {
        let dir = vmm_sys_util::tempdir::TempDir::new().expect("tempdir");
        let _host = UnixListener::bind(dir.as_path().join("v.sock_80")).expect("listen");

        let (out, conns) = exchange(dir.as_path(), vec![from_guest(OP_REQUEST)]);

        assert_eq!(out.len(), 1);
        assert_eq!(out[0].op, OP_RESPONSE);
        assert_eq!(out[0].buf_alloc, CONN_BUF);
        assert_eq!(conns, 1);
    }

    #[test]
    fn garbage_headers_get_a_reset_or_are_dropped() {
        let dir = vmm_sys_util::tempdir::TempDir::new().expect("tempdir");
        let spoofed = Header {
            src_cid: 99,
            ..from_guest(OP_REQUEST)
        };
        let wrong_dst = Header {
            dst_cid: 7,
            ..from_guest(OP_REQUEST)
        };
        let dgram = Header {
            type_: 2,
            ..from_guest(OP_REQUEST)
        };
        let unknown_op = from_guest(99);
        let data_for_nobody = from_guest(OP_RW);
        let rst_for_nobody = from_guest(OP_RST);

        let (out, conns) = exchange(
            dir.as_path(),
            vec![
                spoofed,
                wrong_dst,
                dgram,
                unknown_op,
                data_for_nobody,
                rst_for_nobody,
            ],
        );

        // Spoofed and misaddressed packets are dropped; the datagram, the
        // unknown op and the data without a connection are reset; a reset is
        // never answered.
        assert_eq!(
            out.iter().map(|h| h.op).collect::<Vec<_>>(),
            vec![OP_RST; 3]
        );
        assert_eq!(conns, 0);
    }

    fn guest_connect(src_port: u32, dst_port: u32) -> Header {
        Header {
            src_port,
            dst_port,
            ..from_guest(OP_REQUEST)
        }
    }

    #[test]
    fn a_guest_cannot_open_connections_without_bound_and_the_host_still_gets_in() {
        let dir = vmm_sys_util::tempdir::TempDir::new().expect("tempdir");
        // A host program that accepts but never reads.
        let _never_reads = UnixListener::bind(dir.as_path().join("v.sock_80")).expect("listen");
        let flood = (0..MAX_GUEST_CONNS as u32 + 50)
            .map(|port| guest_connect(5000 + port, 80))
            .collect();
        let harness = harness(dir.as_path(), flood, true);
        let mut events = EventManager::<Arc<Mutex<Harness>>>::new().expect("event loop");
        events.add_subscriber(harness.clone());
        harness.lock().expect("lock").kick.write(1).expect("kick");
        events.run_with_timeout(100).expect("run");
        let mut host = UnixStream::connect(dir.as_path().join("v.sock")).expect("connect");
        host.write_all(b"CONNECT 52\n").expect("connect line");
        for _ in 0..3 {
            events.run_with_timeout(50).expect("run");
        }

        let h = harness.lock().expect("lock");
        let ops: Vec<u16> = h.output.iter().map(|p| p.op).collect();
        let responses = ops.iter().filter(|op| **op == OP_RESPONSE).count();
        let resets = ops.iter().filter(|op| **op == OP_RST).count();
        assert_eq!((responses, resets), (MAX_GUEST_CONNS, 50));
        assert_eq!(
            ops.last(),
            Some(&OP_REQUEST),
            "the host's connection goes through"
        );
        assert_eq!(h.muxer.connection_count(), MAX_GUEST_CONNS + 1);
        assert_eq!(h.muxer.refusals().guest_conns, 50);
    }

    #[test]
    fn a_guest_cannot_connect_to_the_ports_kept_for_host_connections() {
        let dir = vmm_sys_util::tempdir::TempDir::new().expect("tempdir");
        let port = LOCAL_PORT_BASE | 1;
        let _host =
            UnixListener::bind(dir.as_path().join(format!("v.sock_{port}"))).expect("listen");

        let (out, conns) = exchange(dir.as_path(), vec![guest_connect(1234, port)]);

        assert_eq!(out.iter().map(|h| h.op).collect::<Vec<_>>(), vec![OP_RST]);
        assert_eq!(conns, 0);
    }

    #[test]
    fn packets_for_a_guest_that_takes_none_are_bounded() {
        let dir = vmm_sys_util::tempdir::TempDir::new().expect("tempdir");
        let garbage = (0..MAX_CONTROL as u32 + 100)
            .map(|port| Header {
                src_port: port,
                ..from_guest(OP_RW)
            })
            .collect();
        let harness = harness(dir.as_path(), garbage, false);
        let mut events = EventManager::<Arc<Mutex<Harness>>>::new().expect("event loop");
        events.add_subscriber(harness.clone());
        harness.lock().expect("lock").kick.write(1).expect("kick");
        events.run_with_timeout(100).expect("run");

        let h = harness.lock().expect("lock");
        assert_eq!(h.muxer.control.len(), MAX_CONTROL);
        assert_eq!(h.muxer.refusals().control, 100);
    }

    #[test]
    fn host_connections_beyond_the_limit_are_refused_with_a_reason() {
        let dir = vmm_sys_util::tempdir::TempDir::new().expect("tempdir");
        let harness = harness(dir.as_path(), Vec::new(), true);
        let mut events = EventManager::<Arc<Mutex<Harness>>>::new().expect("event loop");
        events.add_subscriber(harness.clone());
        let mut hosts = Vec::new();
        for _ in 0..MAX_HOST_CONNS {
            let mut host = UnixStream::connect(dir.as_path().join("v.sock")).expect("connect");
            host.write_all(b"CONNECT 52\n").expect("connect line");
            hosts.push(host);
            events.run_with_timeout(0).expect("run");
        }
        for _ in 0..3 {
            events.run_with_timeout(20).expect("run");
        }
        let mut extra = UnixStream::connect(dir.as_path().join("v.sock")).expect("connect");
        events.run_with_timeout(50).expect("run");
        let mut reply = String::new();
        extra
            .set_read_timeout(Some(std::time::Duration::from_secs(5)))
            .expect("timeout");
        extra.read_to_string(&mut reply).expect("read");

        let h = harness.lock().expect("lock");
        assert_eq!(h.muxer.connection_count(), MAX_HOST_CONNS);
        assert_eq!(reply, "ERROR too many connections\n");
        assert_eq!(h.muxer.refusals().host_conns, 1);
    }

    /// A host program's connection, as far as the REQUEST sent to the guest.
    struct HostRequest {
        host: UnixStream,
        harness: Arc<Mutex<Harness>>,
        events: EventManager<Arc<Mutex<Harness>>>,
        request: Header,
    }

    fn request_from_host(dir: &Path) -> HostRequest {
        let harness = harness(dir, Vec::new(), true);
        let mut events = EventManager::<Arc<Mutex<Harness>>>::new().expect("event loop");
        events.add_subscriber(harness.clone());
        let mut host = UnixStream::connect(dir.join("v.sock")).expect("connect");
        host.write_all(b"CONNECT 1024\n").expect("connect line");
        for _ in 0..3 {
            events.run_with_timeout(50).expect("run");
        }
        let request = harness
            .lock()
            .expect("lock")
            .output
            .pop()
            .expect("a REQUEST");
        assert_eq!(request.op, OP_REQUEST);
        HostRequest {
            host,
            harness,
            events,
            request,
        }
    }

    #[test]
    fn clones_of_one_snapshot_ask_from_different_host_ports() {
        // A restored guest may still hold (closed) sockets of the port pairs
        // its snapshot's VMM used; every VMM counting from the same port
        // would be refused on them.
        let (a, b) = (
            vmm_sys_util::tempdir::TempDir::new().expect("tempdir"),
            vmm_sys_util::tempdir::TempDir::new().expect("tempdir"),
        );
        let first = request_from_host(a.as_path()).request;
        let second = request_from_host(b.as_path()).request;

        assert!(is_host_port(first.src_port) && is_host_port(second.src_port));
        assert_ne!(first.src_port, second.src_port);
    }

    #[test]
    fn a_host_connection_the_guest_refuses_is_told_so() {
        let dir = vmm_sys_util::tempdir::TempDir::new().expect("tempdir");
        let HostRequest {
            mut host,
            harness,
            mut events,
            request,
        } = request_from_host(dir.as_path());

        harness.lock().expect("lock").input.push(Header {
            src_port: request.dst_port,
            dst_port: request.src_port,
            ..from_guest(OP_RST)
        });
        harness.lock().expect("lock").kick.write(1).expect("kick");
        events.run_with_timeout(100).expect("run");
        let mut reply = String::new();
        host.set_read_timeout(Some(std::time::Duration::from_secs(5)))
            .expect("timeout");
        host.read_to_string(&mut reply).expect("read");

        assert_eq!(
            reply,
            "ERROR the guest refused the connection to port 1024\n"
        );
        assert_eq!(harness.lock().expect("lock").muxer.connection_count(), 0);
    }

    #[test]
    fn connect_lines() {
        assert_eq!(parse_connect(b"CONNECT 52"), Some(52));
        assert_eq!(parse_connect(b"connect  7 "), Some(7));
        assert_eq!(parse_connect(b"CONNECT"), None);
        assert_eq!(parse_connect(b"CONNECT -1"), None);
        assert_eq!(parse_connect(b"OPEN 5"), None);
        assert_eq!(parse_connect(b"\xff\xfe 5"), None);
    }
}
