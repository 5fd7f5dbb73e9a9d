//! Records the commit the binaries were built from (HUSK_COMMIT), for the
//! labels of `husk bench` reports; "unknown" outside a git checkout.

use std::path::Path;

fn main() {
    let git = Path::new("../../.git");
    let mut commit = "unknown".to_owned();
    if let Ok(head) = std::fs::read_to_string(git.join("HEAD")) {
        println!("cargo:rerun-if-changed=../../.git/HEAD");
        let head = head.trim();
        commit = match head.strip_prefix("ref: ") {
            Some(reference) => {
                println!("cargo:rerun-if-changed=../../.git/{reference}");
                println!("cargo:rerun-if-changed=../../.git/packed-refs");
                std::fs::read_to_string(git.join(reference))
                    .ok()
                    .or_else(|| packed(git, reference))
                    .unwrap_or(commit)
            }
            None => head.to_owned(),
        };
    }
    let short: String = commit.trim().chars().take(12).collect();
    println!("cargo:rustc-env=HUSK_COMMIT={short}");
}

/// A reference's commit from `packed-refs` (a fresh clone keeps them there).
fn packed(git: &Path, reference: &str) -> Option<String> {
    std::fs::read_to_string(git.join("packed-refs"))
        .ok()?
        .lines()
        .find_map(|l| {
            l.strip_suffix(reference)?
                .strip_suffix(' ')
                .map(str::to_owned)
        })
}
