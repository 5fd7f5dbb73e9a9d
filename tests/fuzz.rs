//! Fuzzing as a routine: every fuzz target (`husk_vmm::fuzz`,
//! `husk_server::fuzz`: what a guest or an API client controls) runs over its
//! corpus in `vmm/fuzz/corpus/<target>/` and then over random mutations of
//! it for a bounded time, on every test run. This is blind mutation on the
//! stable toolchain, so it finds what is near the corpus; `cargo fuzz` on
//! nightly (`vmm/fuzz`) runs the same targets with coverage guidance.
//!
//! `HUSK_FUZZ_SECONDS` sets the time per target (default 5). A failure
//! prints the seed and saves the input under `target/fuzz-failures/`, from
//! where it belongs in the corpus once fixed.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

type Target = fn(&[u8]);

const TARGETS: &[(&str, Target)] = &[
    ("block_request", husk_vmm::fuzz::block_request),
    ("vsock_packet", husk_vmm::fuzz::vsock_packet),
    ("net_frame", husk_vmm::fuzz::net_frame),
    ("mmio_registers", husk_vmm::fuzz::mmio_registers),
    ("snapshot_state", husk_vmm::fuzz::snapshot_state),
    ("fs_request", husk_vmm::fuzz::fs_request),
    ("balloon_chain", husk_vmm::fuzz::balloon_chain),
    ("agent_frames", husk_server::fuzz::agent_frames),
    ("api_requests", husk_server::fuzz::api_requests),
    ("egress_requests", husk_server::fuzz::egress_requests),
];

/// Largest input a mutation makes.
const MAX_INPUT: usize = 16 << 10;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .find(|d| d.join("rust-toolchain.toml").exists())
        .expect("the repository root holds rust-toolchain.toml")
        .to_owned()
}

/// xorshift64*: small, seeded, reproducible.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// Values that often sit on a boundary.
const INTERESTING: &[u64] = &[
    0,
    1,
    0x7f,
    0x80,
    0xff,
    0x100,
    0x7fff,
    0xffff,
    0x1_0000,
    0x7fff_ffff,
    0xffff_ffff,
    u64::MAX,
    4096,
    4095,
    512,
    16,
];

/// One to eight random edits of `input`, sometimes spliced with `other`.
fn mutate(rng: &mut Rng, input: &[u8], other: &[u8]) -> Vec<u8> {
    let mut out = input.to_vec();
    for _ in 0..1 + rng.below(8) {
        let len = out.len();
        match rng.below(8) {
            0 if len > 0 => {
                let i = rng.below(len);
                out[i] ^= 1 << rng.below(8);
            }
            1 if len > 0 => {
                let i = rng.below(len);
                out[i] = rng.next() as u8;
            }
            2 => {
                let at = rng.below(len + 1);
                let n = 1 + rng.below(16);
                let bytes: Vec<u8> = (0..n).map(|_| rng.next() as u8).collect();
                out.splice(at..at, bytes);
            }
            3 if len > 0 => {
                let at = rng.below(len);
                let n = 1 + rng.below((len - at).min(64));
                out.drain(at..at + n);
            }
            4 if len > 0 => {
                let at = rng.below(len);
                let n = 1 + rng.below((len - at).min(64));
                let copy = out[at..at + n].to_vec();
                let to = rng.below(len + 1);
                out.splice(to..to, copy);
            }
            5 if len > 0 => {
                let value = INTERESTING[rng.below(INTERESTING.len())];
                let width = [1, 2, 4, 8][rng.below(4)];
                let at = rng.below(len);
                let bytes = if rng.below(2) == 0 {
                    value.to_le_bytes()
                } else {
                    value.to_be_bytes()
                };
                let n = width.min(len - at);
                out[at..at + n].copy_from_slice(&bytes[..n]);
            }
            6 if !other.is_empty() => {
                let at = rng.below(len + 1);
                let from = rng.below(other.len());
                let n = 1 + rng.below(other.len() - from);
                out.truncate(at);
                out.extend_from_slice(&other[from..from + n]);
            }
            _ => {
                let at = rng.below(len + 1);
                out.truncate(at);
            }
        }
    }
    out.truncate(MAX_INPUT);
    out
}

fn corpus(target: &str) -> Vec<(PathBuf, Vec<u8>)> {
    let dir = repo().join("vmm/fuzz/corpus").join(target);
    let mut files: Vec<(PathBuf, Vec<u8>)> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.is_file())
        .map(|p| {
            let bytes = std::fs::read(&p).expect("corpus file");
            (p, bytes)
        })
        .collect();
    files.sort();
    files
}

/// Runs `target` on `input`; a panic is returned with the saved input's path.
fn run(name: &str, target: Target, input: &[u8]) -> Result<(), String> {
    let result = std::panic::catch_unwind(|| target(input));
    if result.is_ok() {
        return Ok(());
    }
    let dir = repo().join("target/fuzz-failures");
    let _ = std::fs::create_dir_all(&dir);
    let sum: u64 = input.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x100_0000_01b3)
    });
    let path = dir.join(format!("{name}-{sum:016x}"));
    let _ = std::fs::write(&path, input);
    Err(format!(
        "{name} panicked on {} ({} bytes)",
        path.display(),
        input.len()
    ))
}

fn fuzz(name: &str, target: Target) {
    let budget = std::env::var("HUSK_FUZZ_SECONDS")
        .ok()
        .and_then(|s| s.parse::<f64>().ok())
        .map_or(Duration::from_secs(5), Duration::from_secs_f64);
    let seed = std::env::var("HUSK_FUZZ_SEED")
        .ok()
        .and_then(|s| s.parse::<u64>().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64)
                | 1
        });
    let inputs = corpus(name);
    assert!(!inputs.is_empty(), "{name} has no corpus");
    for (path, bytes) in &inputs {
        if let Err(e) = run(name, target, bytes) {
            panic!("{e} (corpus file {})", path.display());
        }
    }
    let mut rng = Rng(seed);
    let started = Instant::now();
    let mut runs = 0u64;
    while started.elapsed() < budget {
        let a = &inputs[rng.below(inputs.len())].1;
        let b = &inputs[rng.below(inputs.len())].1;
        let input = mutate(&mut rng, a, b);
        if let Err(e) = run(name, target, &input) {
            panic!("{e}; reproduce with HUSK_FUZZ_SEED={seed}");
        }
        runs += 1;
    }
    eprintln!(
        "{name}: {} corpus inputs and {runs} mutations in {:.1} s (seed {seed})",
        inputs.len(),
        started.elapsed().as_secs_f64()
    );
}

#[test]
fn every_fuzz_target_survives_its_corpus_and_mutations_of_it() {
    // One thread per target; each has its own budget.
    let handles: Vec<_> = TARGETS
        .iter()
        .map(|&(name, target)| {
            std::thread::Builder::new()
                .name(name.to_owned())
                .spawn(move || fuzz(name, target))
                .expect("thread")
        })
        .collect();
    let failed: Vec<String> = handles
        .into_iter()
        .zip(TARGETS)
        .filter_map(|(h, (name, _))| h.join().err().map(|_| (*name).to_owned()))
        .collect();
    assert!(failed.is_empty(), "fuzz targets that failed: {failed:?}");
}

/// Every target has a corpus directory, and every corpus directory a target.
#[test]
fn every_corpus_belongs_to_a_target() {
    let dir = repo().join("vmm/fuzz/corpus");
    let mut found: Vec<String> = std::fs::read_dir(&dir)
        .expect("corpus dir")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    found.sort();
    let mut names: Vec<String> = TARGETS.iter().map(|(n, _)| (*n).to_owned()).collect();
    names.sort();
    assert_eq!(found, names);
}

/// The seed inputs of each corpus are the ones made here: each is a valid
/// input of its kind, which mutations start from. After changing one,
/// write them again and commit them:
/// `HUSK_WRITE_SEEDS=1 cargo test -p husk-vmm --test fuzz seed_corpus`.
#[test]
fn the_seed_corpus_is_the_one_made_here() {
    use husk_protocol::{Body, ExecRequest, Frame};
    let write = std::env::var_os("HUSK_WRITE_SEEDS").is_some();
    let put = |target: &str, name: &str, bytes: &[u8]| {
        let dir = repo().join("vmm/fuzz/corpus").join(target);
        if write {
            std::fs::create_dir_all(&dir).expect("dir");
            std::fs::write(dir.join(name), bytes).expect("seed");
        } else {
            let committed = std::fs::read(dir.join(name))
                .unwrap_or_else(|e| panic!("seed {target}/{name}: {e}"));
            assert!(
                committed == bytes,
                "seed {target}/{name} differs from the one made here (see this test's doc)"
            );
        }
    };
    // A chain for `husk_vmm::fuzz::guest`: descriptors, then memory.
    let chain = |descs: &[(u64, u32, u16)], memory: &[(u64, &[u8])]| {
        let mut out = vec![descs.len() as u8];
        for (addr, len, flags) in descs {
            out.extend_from_slice(&addr.to_le_bytes());
            out.extend_from_slice(&len.to_le_bytes());
            out.extend_from_slice(&flags.to_le_bytes());
        }
        let end = memory
            .iter()
            .map(|(a, b)| *a as usize + b.len())
            .max()
            .unwrap_or(0);
        let mut mem = vec![0u8; end];
        for (addr, bytes) in memory {
            mem[*addr as usize..*addr as usize + bytes.len()].copy_from_slice(bytes);
        }
        out.extend_from_slice(&mem);
        out
    };
    const NEXT: u16 = 1;
    const WRITE: u16 = 2;
    let blk_header = |kind: u32, sector: u64| {
        let mut h = kind.to_le_bytes().to_vec();
        h.extend_from_slice(&[0; 4]);
        h.extend_from_slice(&sector.to_le_bytes());
        h
    };
    for (name, kind, data_flags) in [
        ("read", 0u32, NEXT | WRITE),
        ("write", 1, NEXT),
        ("get-id", 8, NEXT | WRITE),
    ] {
        let header = blk_header(kind, 3);
        let seed = chain(
            &[
                (0x1000, 16, NEXT),
                (0x2000, 512, data_flags),
                (0x3000, 1, WRITE),
            ],
            &[(0x1000, &header), (0x2000, &[0xa5; 512])],
        );
        put("block_request", name, &seed);
    }
    put(
        "block_request",
        "flush",
        &chain(
            &[(0x1000, 16, NEXT), (0x3000, 1, WRITE)],
            &[(0x1000, &blk_header(4, 0))],
        ),
    );

    let vsock_header = |op: u16, len: u32| {
        let mut h = Vec::new();
        h.extend_from_slice(&3u64.to_le_bytes()); // src cid
        h.extend_from_slice(&2u64.to_le_bytes()); // dst cid
        h.extend_from_slice(&1024u32.to_le_bytes());
        h.extend_from_slice(&3128u32.to_le_bytes());
        h.extend_from_slice(&len.to_le_bytes());
        h.extend_from_slice(&1u16.to_le_bytes()); // stream
        h.extend_from_slice(&op.to_le_bytes());
        h.extend_from_slice(&0u32.to_le_bytes());
        h.extend_from_slice(&(256u32 << 10).to_le_bytes());
        h.extend_from_slice(&0u32.to_le_bytes());
        h
    };
    put(
        "vsock_packet",
        "request",
        &chain(&[(0x1000, 44, 0)], &[(0x1000, &vsock_header(1, 0))]),
    );
    put(
        "vsock_packet",
        "rw",
        &chain(
            &[(0x1000, 44, NEXT), (0x2000, 5, 0)],
            &[(0x1000, &vsock_header(5, 5)), (0x2000, b"hello")],
        ),
    );
    put(
        "vsock_packet",
        "rst",
        &chain(&[(0x1000, 44, 0)], &[(0x1000, &vsock_header(3, 0))]),
    );

    // FUSE requests: a header (len, opcode, unique, nodeid, ids) and a
    // body in readable buffers, then writable ones for the reply.
    let fuse = |opcode: u32, nodeid: u64, body: &[u8]| {
        let mut r = ((40 + body.len()) as u32).to_le_bytes().to_vec();
        r.extend_from_slice(&opcode.to_le_bytes());
        r.extend_from_slice(&1u64.to_le_bytes());
        r.extend_from_slice(&nodeid.to_le_bytes());
        r.extend_from_slice(&[0; 16]);
        r.extend_from_slice(body);
        r
    };
    let read_in = |fh: u64, size: u32| {
        let mut b = fh.to_le_bytes().to_vec();
        b.extend_from_slice(&0u64.to_le_bytes());
        b.extend_from_slice(&size.to_le_bytes());
        b.extend_from_slice(&[0; 20]);
        b
    };
    let mut create = 66u32.to_le_bytes().to_vec(); // O_RDWR | O_CREAT
    create.extend_from_slice(&0o100644u32.to_le_bytes());
    create.extend_from_slice(&[0; 8]);
    create.extend_from_slice(b"new\0");
    for (name, request, reply) in [
        ("lookup", fuse(1, 1, b"file\0"), 144),
        ("lookup-dotdot", fuse(1, 1, b"..\0"), 144),
        ("getattr", fuse(3, 1, &[0; 16]), 120),
        ("create", fuse(35, 1, &create), 160),
        ("opendir", fuse(27, 1, &[0; 8]), 32),
        ("readdir", fuse(28, 1, &read_in(1, 4096)), 4096),
        ("read", fuse(15, 2, &read_in(1, 64)), 80),
        ("mkdir", fuse(9, 1, b"\xed\x01\0\0\x12\0\0\0d\0"), 144),
    ] {
        let seed = chain(
            &[(0x1000, request.len() as u32, NEXT), (0x4000, reply, WRITE)],
            &[(0x1000, &request)],
        );
        put("fs_request", name, &seed);
    }

    // A free page report of two 4 KiB ranges, and an inflate buffer of
    // two page frame numbers.
    put(
        "balloon_chain",
        "report",
        &chain(&[(0x4000, 4096, NEXT | WRITE), (0x8000, 8192, WRITE)], &[]),
    );
    let pfns: Vec<u8> = [4u32, 9].iter().flat_map(|p| p.to_le_bytes()).collect();
    put(
        "balloon_chain",
        "inflate",
        &chain(&[(0x1000, 8, 0)], &[(0x1000, &pfns)]),
    );

    let mut frame = vec![0u8; 12];
    frame.extend_from_slice(&[0xff; 6]);
    frame.extend_from_slice(&[6, 0, 0, 0, 0, 1]);
    frame.extend_from_slice(&[0x08, 0x06]);
    frame.extend_from_slice(&[0x11; 46]);
    put(
        "net_frame",
        "tx",
        &chain(&[(0x1000, frame.len() as u32, 0)], &[(0x1000, &frame)]),
    );
    put(
        "net_frame",
        "split-tx",
        &chain(
            &[(0x1000, 12, NEXT), (0x2000, (frame.len() - 12) as u32, 0)],
            &[(0x1000, &frame[..12]), (0x2000, &frame[12..])],
        ),
    );
    put(
        "net_frame",
        "rx-buffers",
        &chain(
            &[(0x1000, 1526, WRITE), (0x2000, 1526, WRITE)],
            &[(0x1000, &frame)],
        ),
    );

    // A driver bringing up a block device whose queue holds one read.
    let mut image = vec![0u8; 4096];
    let desc = |i: usize, addr: u64, len: u32, flags: u16, next: u16, image: &mut Vec<u8>| {
        let at = i * 16;
        image[at..at + 8].copy_from_slice(&addr.to_le_bytes());
        image[at + 8..at + 12].copy_from_slice(&len.to_le_bytes());
        image[at + 12..at + 14].copy_from_slice(&flags.to_le_bytes());
        image[at + 14..at + 16].copy_from_slice(&next.to_le_bytes());
    };
    desc(0, 0x8400, 16, NEXT, 1, &mut image);
    desc(1, 0x8800, 512, NEXT | WRITE, 2, &mut image);
    desc(2, 0x8300, 1, WRITE, 0, &mut image);
    image[0x102..0x104].copy_from_slice(&1u16.to_le_bytes()); // avail idx
    image[0x400..0x410].copy_from_slice(&blk_header(0, 1));
    let op = |kind: u8, offset: u16, value: u32| {
        let mut o = vec![kind];
        o.extend_from_slice(&offset.to_le_bytes());
        o.extend_from_slice(&value.to_le_bytes());
        o
    };
    let mut mmio = image;
    for (kind, offset, value) in [
        (0, 0x000, 0),
        (0, 0x008, 0),
        (3, 0x070, 1),
        (3, 0x070, 3),
        (3, 0x014, 1),
        (0, 0x010, 0),
        (3, 0x024, 1),
        (3, 0x020, 1),
        (3, 0x070, 11),
        (0, 0x070, 0),
        (3, 0x030, 0),
        (0, 0x034, 0),
        (3, 0x038, 16),
        (3, 0x080, 0x8000),
        (3, 0x084, 0),
        (3, 0x090, 0x8100),
        (3, 0x094, 0),
        (3, 0x0a0, 0x8200),
        (3, 0x0a4, 0),
        (3, 0x044, 1),
        (3, 0x070, 15),
        (3, 0x050, 0),
        (0, 0x060, 0),
        (3, 0x064, 1),
        (0, 0x100, 0),
        (0, 0x0fc, 0),
        (3, 0x070, 0),
    ] {
        mmio.extend_from_slice(&op(kind, offset, value));
    }
    put("mmio_registers", "bring-up-and-read", &mmio);

    let frames = [
        Body::Hello {
            version: husk_protocol::VERSION,
        },
        Body::Ping,
        Body::Exec(ExecRequest {
            argv: vec!["sh".into(), "-c".into(), "echo hi".into()],
            timeout_ms: Some(1000),
            output_max: Some(4096),
            ..ExecRequest::default()
        }),
        Body::Output {
            stream: husk_protocol::Stream::Stdout,
            data: b"hi\n".to_vec(),
        },
        Body::KillAll,
        Body::KilledAll { tasks: 3 },
        Body::Error {
            kind: husk_protocol::ErrorKind::Limit,
            message: "too many".into(),
        },
    ];
    let mut stream = Vec::new();
    for (id, body) in frames.into_iter().enumerate() {
        husk_protocol::write_frame(
            &mut stream,
            &Frame {
                id: id as u64,
                body,
            },
        )
        .expect("encode");
    }
    put("agent_frames", "session", &stream);

    for (name, body) in [
        (
            "create",
            r#"{"template":"base","ttl_s":60,"labels":{"a":"b"},"egress":{"allow":["api.example.com","*.example.org:443","[2001:db8::1]:8080"]}}"#,
        ),
        (
            "template",
            r#"{"name":"t","vcpus":2,"mem_mib":256,"warmup":[["true"]],"network":true,"block_limit":"bytes=10M,ops=100","net_limit":"bytes=1M"}"#,
        ),
        (
            "exec",
            r#"{"argv":["sh","-c","true"],"env":{"K":"V"},"cwd":"/tmp","user":{"uid":1,"gid":1},"stdin":"x","timeout_ms":5,"pids_max":7,"output_max":9}"#,
        ),
        (
            "update",
            r#"{"ttl_s":0,"on_expiry":"pause","labels":{"x":""}}"#,
        ),
        ("query", "label=team%3Da&state=running&label=x%3D%2B+y"),
    ] {
        put("api_requests", name, body.as_bytes());
    }

    put(
        "egress_requests",
        "connect",
        b"CONNECT api.example.com:443 HTTP/1.1\r\nHost: api.example.com:443\r\n\r\n",
    );
    put(
        "egress_requests",
        "get",
        b"GET http://example.com:8080/a?b HTTP/1.1\r\nHost: x\r\nProxy-Authorization: Basic eA==\r\n\r\n",
    );
    put(
        "egress_requests",
        "allowlist",
        b"api.example.com\n*.example.org:443\n203.0.113.7\n[::1]:80\n*\n",
    );
    let name = "api.example.com";
    let n = name.len() as u16;
    let mut ext = vec![0, 0];
    ext.extend_from_slice(&(n + 5).to_be_bytes());
    ext.extend_from_slice(&(n + 3).to_be_bytes());
    ext.push(0);
    ext.extend_from_slice(&n.to_be_bytes());
    ext.extend_from_slice(name.as_bytes());
    let mut body = vec![3, 3];
    body.extend_from_slice(&[7; 32]);
    body.extend_from_slice(&[0, 0, 2, 0x13, 0x01, 1, 0]);
    body.extend_from_slice(&(ext.len() as u16).to_be_bytes());
    body.extend_from_slice(&ext);
    let mut hs = vec![1, 0];
    hs.extend_from_slice(&(body.len() as u16).to_be_bytes());
    hs.extend_from_slice(&body);
    let mut hello = vec![0x16, 3, 1];
    hello.extend_from_slice(&(hs.len() as u16).to_be_bytes());
    hello.extend_from_slice(&hs);
    put("egress_requests", "client-hello", &hello);
}
