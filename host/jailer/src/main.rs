//! husk-jailer: runs a program (husk-vmm) in a jail of its own; see
//! `husk_jailer`. The daemon starts every VMM through it; by hand:
//!
//! ```text
//! husk-jailer --id vm1 --uid 200001 --gid 200001 \
//!     --bind-ro /srv/snapshots/base --bind /srv/run/vm1 \
//!     -- /usr/local/bin/husk-vmm --restore /srv/snapshots/base ...
//! ```
//!
//! Paths keep their host names inside the jail, so the program's arguments
//! need no rewriting. Run as root; the program runs as `--uid`/`--gid`.
//!
//! A running jail's VMM is given further shared directories by the daemon
//! (`husk_jailer::share_tree`), not by this program.

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use husk_jailer::{Bind, Jail, Share, DEFAULT_NOFILE};

#[derive(Debug, Parser)]
#[command(name = "husk-jailer", version, about = "Run husk-vmm in a jail")]
struct Args {
    /// The jail's name (its host name inside): letters, digits, - and _.
    #[arg(long)]
    id: String,
    /// The unprivileged uid the program runs as.
    #[arg(long)]
    uid: u32,
    /// The unprivileged gid the program runs as.
    #[arg(long)]
    gid: u32,
    /// A file or directory the program may read and write. Repeatable.
    #[arg(long = "bind")]
    binds: Vec<PathBuf>,
    /// A file or directory the program may only read. Repeatable.
    #[arg(long = "bind-ro")]
    binds_ro: Vec<PathBuf>,
    /// A directory shared with the guest, `UID:GID:PATH`: mounted idmapped,
    /// so the program reads and writes the files of UID:GID (on the host)
    /// as its own, and what it creates there is theirs. Repeatable.
    #[arg(long = "share", value_parser = |s: &str| Share::parse(s, true))]
    shares: Vec<Share>,
    /// As --share, read-only.
    #[arg(long = "share-ro", value_parser = |s: &str| Share::parse(s, false))]
    shares_ro: Vec<Share>,
    /// Create this TAP in the jail's network namespace, owned by --uid.
    #[arg(long)]
    tap: Option<String>,
    /// The KVM device, made inside the jail as /dev/kvm.
    #[arg(long, default_value = "/dev/kvm")]
    kvm_device: PathBuf,
    /// Most files the program may have open.
    #[arg(long, default_value_t = DEFAULT_NOFILE)]
    nofile: u64,
    /// Largest file the program may write, in bytes.
    #[arg(long)]
    fsize: Option<u64>,
    /// The program (an absolute path) and its arguments.
    #[arg(last = true, required = true)]
    command: Vec<OsString>,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let mut command = args.command.into_iter();
    let Some(program) = command.next().map(PathBuf::from) else {
        eprintln!("husk-jailer: give the program to run after --");
        return ExitCode::from(2);
    };
    let rest: Vec<OsString> = command.collect();
    let binds = args
        .binds
        .into_iter()
        .map(|path| Bind {
            path,
            writable: true,
        })
        .chain(args.binds_ro.into_iter().map(|path| Bind {
            path,
            writable: false,
        }))
        .collect();
    let jail = Jail {
        id: args.id,
        uid: args.uid,
        gid: args.gid,
        binds,
        shares: args.shares.into_iter().chain(args.shares_ro).collect(),
        tap: args.tap,
        kvm_device: args.kvm_device,
        nofile: args.nofile,
        fsize: args.fsize,
    };
    match jail.exec(&program, &rest) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("husk-jailer: {e}");
            ExitCode::from(2)
        }
    }
}
