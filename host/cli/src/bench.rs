//! `husk bench`: cold boot, snapshot restore and pooled create of one
//! guest, with QEMU's microvm next to it when installed and Firecracker
//! when given; a live progress
//! display on stderr, the table on stdout, and on request the JSON report
//! (schema: `husk bench --schema`) and an SVG chart.

use std::path::PathBuf;
use std::time::Duration;

use husk_bench::{self as bench, BenchConfig};

#[derive(Debug, clap::Args)]
pub struct BenchArgs {
    /// Runs of each contender and mode (interleaved run by run).
    #[arg(long, short = 'n', default_value_t = 10)]
    iterations: usize,
    /// Of those runs, how many cold boot (the first ones; default: all):
    /// the rest only restore (and create from the pool).
    #[arg(long)]
    cold_boots: Option<usize>,
    /// Clones of one snapshot alive at once, for the memory they take
    /// together (0: none).
    #[arg(long, default_value_t = 4)]
    clones: usize,
    /// Clones parked in the daemon's warm pool at once, for what each
    /// costs the host and where it goes (0: none).
    #[arg(long, default_value_t = 0)]
    parked: usize,
    #[arg(long, env = "HUSK_KERNEL")]
    kernel: Option<PathBuf>,
    #[arg(long, env = "HUSK_INITRAMFS")]
    initramfs: Option<PathBuf>,
    /// The husk-vmm binary (default: next to this one).
    #[arg(long, env = "HUSK_VMM")]
    vmm: Option<PathBuf>,
    #[arg(long, default_value_t = 128)]
    mem_mib: u32,
    #[arg(long, default_value_t = 1)]
    vcpus: u8,
    /// QEMU binary (default: qemu-system-x86_64 on $PATH, skipped when
    /// missing).
    #[arg(long)]
    qemu: Option<PathBuf>,
    /// Leave QEMU out.
    #[arg(long, conflicts_with = "qemu")]
    no_qemu: bool,
    /// A Firecracker binary to run the same guest under (default:
    /// ../shared/peers/firecracker where it exists; skipped without one).
    #[arg(long, env = "HUSK_FIRECRACKER")]
    firecracker: Option<PathBuf>,
    /// Leave the pooled path (a private daemon and its template build) out.
    #[arg(long)]
    no_pooled: bool,
    /// Write the report as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Write the chart as SVG here.
    #[arg(long)]
    svg: Option<PathBuf>,
    /// Print the JSON report's schema and exit.
    #[arg(long)]
    schema: bool,
}

pub fn bench(args: BenchArgs) -> Result<u8, String> {
    if args.schema {
        print!("{}", bench::report::JSON_SCHEMA);
        return Ok(0);
    }
    if args.iterations == 0 {
        return Err("--iterations must be at least 1".into());
    }
    let cold_boots = args.cold_boots.unwrap_or(args.iterations);
    if !(1..=args.iterations).contains(&cold_boots) {
        return Err(format!(
            "--cold-boots must be 1 to --iterations ({}), not {cold_boots}",
            args.iterations
        ));
    }
    if args.parked > 0 && args.no_pooled {
        return Err("--parked needs the pooled path (leave out --no-pooled)".into());
    }
    let need = |p: Option<PathBuf>, what: &str| {
        p.ok_or_else(|| {
            format!(
                "no {what}: pass --{what} or set HUSK_{}",
                what.to_uppercase()
            )
        })
    };
    let kernel = need(args.kernel, "kernel")?;
    let initramfs = need(args.initramfs, "initramfs")?;
    let this = std::env::current_exe().map_err(|e| e.to_string())?;
    let vmm = args.vmm.unwrap_or_else(|| this.with_file_name("husk-vmm"));
    let qemu = match args.no_qemu {
        true => Err("left out (--no-qemu)".to_owned()),
        false => bench::qemu::probe(args.qemu.as_deref()),
    };
    let firecracker = bench::firecracker::probe(args.firecracker.as_deref());
    let work = tempdir()?;
    let config = BenchConfig {
        vmm,
        kernel,
        initramfs,
        mem_mib: args.mem_mib,
        vcpus: args.vcpus,
        iterations: args.iterations,
        cold_boots,
        clones: args.clones,
        parked: args.parked,
        husk: (!args.no_pooled).then_some(this),
        qemu,
        firecracker,
        work_dir: work.0.clone(),
        boot_budget: Duration::from_secs(900),
        restore_budget: Duration::from_secs(120),
    };
    let started = std::time::Instant::now();
    let mut progress = |line: &str| {
        eprintln!("[{:>7.1} s] {line}", started.elapsed().as_secs_f64());
    };
    let report = bench::run(&config, &mut progress).map_err(|e| e.to_string())?;
    print!("{}", report.table());
    if let Some(path) = &args.json {
        let text = serde_json::to_string_pretty(&report).map_err(|e| e.to_string())?;
        std::fs::write(path, text + "\n")
            .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    }
    if let Some(path) = &args.svg {
        std::fs::write(path, bench::svg::render(&report))
            .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    }
    let failed = report
        .series
        .iter()
        .any(|s| s.status == bench::report::Status::Failed);
    Ok(if failed { 1 } else { 0 })
}

/// A private directory for the runs' files, removed when dropped.
struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn tempdir() -> Result<TempDir, String> {
    let base = std::env::temp_dir().join("husk-bench.XXXXXX");
    nix::unistd::mkdtemp(&base)
        .map(TempDir)
        .map_err(|e| format!("cannot create a directory under {}: {e}", base.display()))
}
