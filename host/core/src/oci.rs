//! Container images as root file systems: a `docker save` archive or an
//! OCI image layout (a directory, or a tar of one). The manifest for
//! linux/amd64 is picked (from an index, or nested indexes two deep), each
//! layer's digest is checked as it is read, and the layers are applied in
//! order onto the stage with the OCI rules: `.wh.NAME` removes NAME from
//! the layers below, `.wh..wh..opq` empties its directory of them. Layers
//! are tar, gzip or zstd (its frames one after another, skippable frames
//! such as zstd:chunked's table of contents passed over), told apart by
//! their first bytes.
//!
//! An image is hostile input like any archive (see `rootfs`): its entries
//! get the same checks (`archive`), blob and layer paths must stay in the image, a
//! whiteout never acts through a symbolic link out of the stage, and the
//! unpacked size is bounded ([`MAX_UNPACKED`]).

use std::collections::HashSet;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};

use serde::Deserialize;
use sha2::{Digest, Sha256};

use crate::archive::{
    archive_reader, checked_entry, is_contained, unpack, unpack_entry, ArchiveError,
};
use husk_types::ImageConfig;

/// The most bytes an image's layers may unpack to, all together.
pub const MAX_UNPACKED: u64 = 64 << 30;
/// Largest manifest, index or config read into memory.
const MAX_JSON: u64 = 4 << 20;
/// Where the image's config for the guest goes in the root file system;
/// guest-init reads it at boot (see guest-init's `image.rs`).
pub const GUEST_CONFIG: &str = ".husk-image";

const WHITEOUT: &str = ".wh.";
const OPAQUE: &str = ".wh..wh..opq";

fn invalid(what: impl std::fmt::Display) -> ArchiveError {
    ArchiveError::Invalid(format!("image: {what}"))
}

/// Unpacks the image at `source` onto `stage`, using `scratch` (removed
/// after) for an archive's contents; returns its config.
pub fn unpack_image(
    source: &Path,
    stage: &Path,
    scratch: &Path,
) -> Result<ImageConfig, ArchiveError> {
    let result = if source.is_dir() {
        apply(source, stage)
    } else {
        let _ = std::fs::remove_dir_all(scratch);
        std::fs::create_dir_all(scratch).map_err(|e| ArchiveError::Io(scratch.to_owned(), e))?;
        unpack(source, scratch).and_then(|()| apply(scratch, stage))
    };
    let _ = std::fs::remove_dir_all(scratch);
    result
}

/// An image's parts: its config blob and layers, with the digests to
/// check them by (a `docker save` archive's layer files have none).
struct Parts {
    config: Blob,
    layers: Vec<Blob>,
}

struct Blob {
    path: PathBuf,
    digest: Option<String>,
}

fn apply(root: &Path, stage: &Path) -> Result<ImageConfig, ArchiveError> {
    let parts = if root.join("index.json").is_file() {
        oci_parts(root)?
    } else if root.join("manifest.json").is_file() {
        docker_parts(root)?
    } else {
        return Err(invalid(
            "neither an OCI image layout (index.json) nor a `docker save` archive (manifest.json)",
        ));
    };
    let config: ConfigFile = serde_json::from_slice(&read_blob(&parts.config)?)
        .map_err(|e| invalid(format!("its config: {e}")))?;
    let mut budget = MAX_UNPACKED;
    for (i, layer) in parts.layers.iter().enumerate() {
        apply_layer(layer, stage, &mut budget)
            .map_err(|e| invalid(format!("layer {} of {}: {e}", i + 1, parts.layers.len())))?;
    }
    let c = config.config.unwrap_or_default();
    Ok(ImageConfig {
        env: c.env.unwrap_or_default(),
        working_dir: c.working_dir.filter(|d| !d.is_empty()),
        user: c.user.filter(|u| !u.is_empty()),
        entrypoint: c.entrypoint.unwrap_or_default(),
        cmd: c.cmd.unwrap_or_default(),
    })
}

#[derive(Deserialize)]
struct ConfigFile {
    config: Option<RunConfig>,
}

#[derive(Default, Deserialize)]
#[serde(rename_all = "PascalCase")]
struct RunConfig {
    env: Option<Vec<String>>,
    working_dir: Option<String>,
    user: Option<String>,
    entrypoint: Option<Vec<String>>,
    cmd: Option<Vec<String>>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Descriptor {
    #[serde(default)]
    media_type: String,
    digest: String,
    #[serde(default)]
    platform: Option<Platform>,
}

#[derive(Deserialize)]
struct Platform {
    architecture: String,
    os: String,
}

#[derive(Deserialize)]
struct Index {
    manifests: Vec<Descriptor>,
}

#[derive(Deserialize)]
struct Manifest {
    config: Descriptor,
    layers: Vec<Descriptor>,
}

fn oci_parts(root: &Path) -> Result<Parts, ArchiveError> {
    let mut index: Index = json(&root.join("index.json"))?;
    for _ in 0..3 {
        let chosen = pick(index.manifests)?;
        let bytes = read_blob(&blob(root, &chosen.digest)?)?;
        if chosen.media_type.contains("index") || chosen.media_type.contains("manifest.list") {
            index = serde_json::from_slice(&bytes)
                .map_err(|e| invalid(format!("index {}: {e}", chosen.digest)))?;
            continue;
        }
        let manifest: Manifest = serde_json::from_slice(&bytes)
            .map_err(|e| invalid(format!("manifest {}: {e}", chosen.digest)))?;
        return Ok(Parts {
            config: blob(root, &manifest.config.digest)?,
            layers: manifest
                .layers
                .iter()
                .map(|l| blob(root, &l.digest))
                .collect::<Result<_, _>>()?,
        });
    }
    Err(invalid("indexes nested more than three deep"))
}

/// The manifest for linux/amd64, or the only one.
fn pick(manifests: Vec<Descriptor>) -> Result<Descriptor, ArchiveError> {
    if manifests.len() == 1 {
        return manifests
            .into_iter()
            .next()
            .ok_or_else(|| invalid("no manifest"));
    }
    manifests
        .into_iter()
        .find(|m| {
            m.platform
                .as_ref()
                .is_some_and(|p| p.os == "linux" && p.architecture == "amd64")
        })
        .ok_or_else(|| invalid("no manifest for linux/amd64 in its index"))
}

#[derive(Deserialize)]
#[serde(rename_all = "PascalCase")]
struct DockerManifest {
    config: String,
    layers: Vec<String>,
}

fn docker_parts(root: &Path) -> Result<Parts, ArchiveError> {
    let mut images: Vec<DockerManifest> = json(&root.join("manifest.json"))?;
    if images.len() != 1 {
        return Err(invalid(format!(
            "manifest.json lists {} images: save one image per archive",
            images.len()
        )));
    }
    let image = images.remove(0);
    let file = |name: &str| {
        if !is_contained(Path::new(name)) {
            return Err(invalid(format!("`{name}` leaves the archive")));
        }
        // Newer archives name layers by their digest: check it then.
        let digest = name
            .strip_prefix("blobs/sha256/")
            .map(|hex| format!("sha256:{hex}"));
        Ok(Blob {
            path: root.join(name),
            digest,
        })
    };
    Ok(Parts {
        config: file(&image.config)?,
        layers: image
            .layers
            .iter()
            .map(|l| file(l))
            .collect::<Result<_, _>>()?,
    })
}

/// `blobs/sha256/HEX` for a well-formed sha256 digest.
fn blob(root: &Path, digest: &str) -> Result<Blob, ArchiveError> {
    let hex = digest
        .strip_prefix("sha256:")
        .filter(|h| h.len() == 64 && h.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')))
        .ok_or_else(|| invalid(format!("digest `{digest}`: only sha256 digests are read")))?;
    Ok(Blob {
        path: root.join("blobs/sha256").join(hex),
        digest: Some(digest.to_owned()),
    })
}

fn json<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T, ArchiveError> {
    let bytes = read_limited(path)?;
    serde_json::from_slice(&bytes).map_err(|e| invalid(format!("{}: {e}", file_name(path))))
}

fn file_name(path: &Path) -> String {
    path.file_name()
        .map_or_else(String::new, |n| n.to_string_lossy().into_owned())
}

fn read_limited(path: &Path) -> Result<Vec<u8>, ArchiveError> {
    let file = open(path)?;
    let mut bytes = Vec::new();
    file.take(MAX_JSON + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| ArchiveError::Io(path.to_owned(), e))?;
    if bytes.len() as u64 > MAX_JSON {
        return Err(invalid(format!(
            "{} is over {MAX_JSON} bytes",
            file_name(path)
        )));
    }
    Ok(bytes)
}

fn open(path: &Path) -> Result<std::fs::File, ArchiveError> {
    // Not through a symbolic link: the archive's own files only.
    if path.symlink_metadata().is_ok_and(|m| !m.is_file()) {
        return Err(invalid(format!("{} is not a plain file", file_name(path))));
    }
    std::fs::File::open(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => invalid(format!("{} is missing", file_name(path))),
        _ => ArchiveError::Io(path.to_owned(), e),
    })
}

/// A small blob, its digest checked.
fn read_blob(blob: &Blob) -> Result<Vec<u8>, ArchiveError> {
    let bytes = read_limited(&blob.path)?;
    if let Some(digest) = &blob.digest {
        check_digest(digest, &Sha256::digest(&bytes).into())?;
    }
    Ok(bytes)
}

fn check_digest(expected: &str, got: &[u8; 32]) -> Result<(), ArchiveError> {
    let hex: String = got.iter().map(|b| format!("{b:02x}")).collect();
    if expected.strip_prefix("sha256:") == Some(hex.as_str()) {
        Ok(())
    } else {
        Err(invalid(format!(
            "blob {expected} does not match its digest (sha256:{hex})"
        )))
    }
}

/// Reads through, hashing what it reads.
struct Hashing<R> {
    inner: R,
    hash: Sha256,
}

impl<R: Read> Read for Hashing<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.hash.update(&buf[..n]);
        Ok(n)
    }
}

/// A zstd stream: its frames one after another (as `zstd` and `pzstd`
/// may write them), skippable frames passed over. A frame may ask for a
/// window of at most 100 MiB (the decoder's limit): a larger one is an
/// error, not an allocation.
struct Zstd<R> {
    source: R,
    frame: ruzstd::decoding::FrameDecoder,
    /// Inside a frame (its header read, its end not reached).
    in_frame: bool,
}

impl<R: BufRead> Zstd<R> {
    fn new(source: R) -> Self {
        // The decoder holds a frame's window to its limit only once it has
        // read a frame (the first one's window is taken as it comes): an
        // empty frame first, so that every frame of the layer is checked.
        const EMPTY_FRAME: [u8; 9] = [0x28, 0xb5, 0x2f, 0xfd, 0x20, 0x00, 0x01, 0x00, 0x00];
        let mut frame = ruzstd::decoding::FrameDecoder::new();
        if let Err(e) = frame.init(&EMPTY_FRAME[..]) {
            tracing::error!("zstd: the empty frame was refused: {e}");
        }
        Zstd {
            source,
            frame,
            in_frame: false,
        }
    }
}

impl<R: BufRead> Read for Zstd<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        use ruzstd::decoding::errors::{FrameDecoderError, ReadFrameHeaderError};
        use ruzstd::decoding::BlockDecodingStrategy;
        if buf.is_empty() {
            return Ok(0);
        }
        loop {
            if self.in_frame {
                while self.frame.can_collect() < buf.len() && !self.frame.is_finished() {
                    let wanted = buf.len() - self.frame.can_collect();
                    self.frame
                        .decode_blocks(&mut self.source, BlockDecodingStrategy::UptoBytes(wanted))
                        .map_err(std::io::Error::other)?;
                }
                let n = self.frame.read(buf)?;
                if n > 0 {
                    return Ok(n);
                }
                self.in_frame = !self.frame.is_finished();
                continue;
            }
            // Between frames: the stream's end, or the next frame.
            if self.source.fill_buf()?.is_empty() {
                return Ok(0);
            }
            match self.frame.reset(&mut self.source) {
                Ok(()) => self.in_frame = true,
                Err(FrameDecoderError::ReadFrameHeaderError(ReadFrameHeaderError::SkipFrame {
                    length,
                    ..
                })) => {
                    let skipped = std::io::copy(
                        &mut (&mut self.source).take(u64::from(length)),
                        &mut std::io::sink(),
                    )?;
                    if skipped != u64::from(length) {
                        return Err(std::io::Error::new(
                            std::io::ErrorKind::UnexpectedEof,
                            "zstd: a skippable frame is cut short",
                        ));
                    }
                }
                Err(e) => return Err(std::io::Error::other(format!("zstd: {e}"))),
            }
        }
    }
}

fn apply_layer(layer: &Blob, stage: &Path, budget: &mut u64) -> Result<(), String> {
    let file = open(&layer.path).map_err(|e| e.to_string())?;
    let mut hashing = BufReader::new(Hashing {
        inner: file,
        hash: Sha256::new(),
    });
    let magic = hashing.fill_buf().map_err(|e| e.to_string())?;
    let reader: Box<dyn Read + '_> = match magic {
        [0x1f, 0x8b, ..] => Box::new(flate2::read::GzDecoder::new(&mut hashing)),
        [0x28, 0xb5, 0x2f, 0xfd, ..] => Box::new(Zstd::new(&mut hashing)),
        _ => Box::new(&mut hashing),
    };
    let mut tar = archive_reader(reader);
    // Paths this layer put in place: a whiteout or an opaque directory in
    // it removes only what the layers below left.
    let mut own: HashSet<PathBuf> = HashSet::new();
    for entry in tar.entries().map_err(|e| e.to_string())? {
        let mut entry = entry.map_err(|e| format!("unreadable entry: {e}"))?;
        let Some(path) = checked_entry(&entry)? else {
            continue;
        };
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let parent = path.parent().unwrap_or(Path::new(""));
        if name == OPAQUE {
            let dir = resolve(stage, parent)?;
            for child in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
                let rel = parent.join(child.file_name());
                if !own.contains(&rel) {
                    remove(&child.path())?;
                }
            }
            continue;
        }
        if let Some(hidden) = name.strip_prefix(WHITEOUT) {
            let rel = parent.join(hidden);
            if !own.contains(&rel) {
                let target = resolve(stage, parent)?.join(hidden);
                remove(&target)?;
            }
            continue;
        }
        let size = entry.header().size().unwrap_or(0);
        *budget = budget
            .checked_sub(size)
            .ok_or_else(|| format!("the image unpacks to more than {} GiB", MAX_UNPACKED >> 30))?;
        // What a lower layer left where this entry goes is replaced
        // whole, unless both are directories (the directory is kept, its
        // mode and owner updated).
        let target = resolve(stage, parent)?.join(&name);
        let is_dir = entry.header().entry_type().is_dir();
        if let Ok(meta) = target.symlink_metadata() {
            if !(is_dir && meta.is_dir()) {
                remove(&target)?;
            }
        }
        unpack_entry(&mut entry, &path, stage)?;
        own.insert(path);
    }
    // Whatever follows the archive's end (padding) is part of the blob.
    drop(tar);
    std::io::copy(&mut hashing, &mut std::io::sink()).map_err(|e| e.to_string())?;
    if let Some(digest) = &layer.digest {
        let got: [u8; 32] = hashing.into_inner().hash.finalize().into();
        check_digest(digest, &got).map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// `rel` (a directory) in `stage`, its symbolic links resolved one
/// component at a time; refused if one leads out of the stage (an
/// absolute link resolves against the host, so it is refused too). What
/// does not exist yet is appended as it is: nothing is below it.
fn resolve(stage: &Path, rel: &Path) -> Result<PathBuf, String> {
    let root = std::fs::canonicalize(stage).map_err(|e| e.to_string())?;
    let mut cur = root.clone();
    for part in rel.components() {
        let std::path::Component::Normal(part) = part else {
            continue;
        };
        let next = cur.join(part);
        cur = match next.symlink_metadata() {
            Ok(m) if m.file_type().is_symlink() => match std::fs::canonicalize(&next) {
                Ok(real) if real.starts_with(&root) => real,
                _ => {
                    return Err(format!(
                        "`{}` goes through a symbolic link that leads out of the image",
                        rel.display()
                    ))
                }
            },
            _ => next,
        };
    }
    Ok(cur)
}

/// Removes a file, a symbolic link (not what it points to) or a tree.
fn remove(path: &Path) -> Result<(), String> {
    match path.symlink_metadata() {
        Ok(m) if m.is_dir() => std::fs::remove_dir_all(path),
        Ok(_) => std::fs::remove_file(path),
        Err(_) => Ok(()),
    }
    .map_err(|e| format!("removing {}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    /// What a test layer holds.
    enum E<'a> {
        File(&'a str, &'a str),
        Dir(&'a str),
        Link(&'a str, &'a str),
    }

    fn layer(entries: &[E<'_>]) -> Vec<u8> {
        let mut b = tar::Builder::new(Vec::new());
        for e in entries {
            let mut h = tar::Header::new_gnu();
            h.set_uid(0);
            h.set_gid(0);
            h.set_mtime(0);
            match e {
                E::File(path, content) => {
                    h.set_entry_type(tar::EntryType::Regular);
                    h.set_size(content.len() as u64);
                    h.set_mode(0o644);
                    b.append_data(&mut h, path, content.as_bytes())
                        .expect("file");
                }
                E::Dir(path) => {
                    h.set_entry_type(tar::EntryType::Directory);
                    h.set_size(0);
                    h.set_mode(0o755);
                    b.append_data(&mut h, path, &[][..]).expect("dir");
                }
                E::Link(path, target) => {
                    h.set_entry_type(tar::EntryType::Symlink);
                    h.set_size(0);
                    b.append_link(&mut h, path, target).expect("link");
                }
            }
        }
        b.into_inner().expect("tar")
    }

    fn gzip(bytes: &[u8]) -> Vec<u8> {
        let mut z = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        z.write_all(bytes).expect("gzip");
        z.finish().expect("gzip")
    }

    /// `bytes` as zstd frames of at most `frame` bytes each, then a
    /// skippable frame (as zstd:chunked's table of contents).
    fn zstd(bytes: &[u8], frame: usize) -> Vec<u8> {
        let mut out: Vec<u8> = bytes
            .chunks(frame)
            .flat_map(|c| {
                ruzstd::encoding::compress_to_vec(c, ruzstd::encoding::CompressionLevel::Fastest)
            })
            .collect();
        out.extend_from_slice(&0x184d_2a50u32.to_le_bytes());
        out.extend_from_slice(&5u32.to_le_bytes());
        out.extend_from_slice(b"toc!!");
        out
    }

    fn sha(bytes: &[u8]) -> String {
        let hex: String = Sha256::digest(bytes)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        format!("sha256:{hex}")
    }

    fn temp(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("husk-oci-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("temp");
        dir
    }

    const CONFIG: &str = r#"{"architecture":"amd64","os":"linux","config":{"Env":["PATH=/bin","A=b"],"WorkingDir":"/app","User":"app","Entrypoint":["/bin/sh","-c"],"Cmd":["echo hi"]}}"#;

    /// An OCI layout in `dir` with `layers` (already compressed or not).
    fn oci_layout(dir: &Path, layers: &[Vec<u8>]) {
        let blobs = dir.join("blobs/sha256");
        std::fs::create_dir_all(&blobs).expect("blobs");
        let put = |bytes: &[u8]| {
            let digest = sha(bytes);
            std::fs::write(blobs.join(&digest[7..]), bytes).expect("blob");
            digest
        };
        let config = put(CONFIG.as_bytes());
        let layers: Vec<String> = layers
            .iter()
            .map(|l| {
                format!(
                    r#"{{"mediaType":"application/vnd.oci.image.layer.v1.tar","digest":"{}","size":{}}}"#,
                    put(l),
                    l.len()
                )
            })
            .collect();
        let manifest = format!(
            r#"{{"schemaVersion":2,"config":{{"mediaType":"application/vnd.oci.image.config.v1+json","digest":"{config}","size":{}}},"layers":[{}]}}"#,
            CONFIG.len(),
            layers.join(",")
        );
        let m = put(manifest.as_bytes());
        std::fs::write(
            dir.join("index.json"),
            format!(
                r#"{{"schemaVersion":2,"manifests":[{{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"{m}","size":{}}}]}}"#,
                manifest.len()
            ),
        )
        .expect("index");
        std::fs::write(dir.join("oci-layout"), r#"{"imageLayoutVersion":"1.0.0"}"#)
            .expect("oci-layout");
    }

    fn lower() -> Vec<u8> {
        layer(&[
            E::Dir("opt"),
            E::Dir("opt/old"),
            E::File("opt/old/gone.txt", "gone"),
            E::Dir("opt/dir"),
            E::File("opt/dir/lower.txt", "lower"),
            E::File("opt/keep.txt", "kept"),
            E::File("opt/file-then-dir", "a file"),
        ])
    }

    fn listing(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .expect("dir")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    #[test]
    fn zstd_layers_of_several_frames_apply_as_gzip_ones_do() {
        let dir = temp("zstd");
        let upper = layer(&[
            E::File("opt/.wh.old", ""),
            E::File("opt/dir/upper.txt", &"upper ".repeat(1000)),
        ]);
        assert!(upper.len() > 3 * 1024, "several frames");
        oci_layout(
            &dir.join("image"),
            &[zstd(&lower(), 1 << 20), zstd(&upper, 1024)],
        );
        let stage = dir.join("stage");
        std::fs::create_dir_all(&stage).expect("stage");
        unpack_image(&dir.join("image"), &stage, &dir.join("scratch")).expect("unpack");

        assert_eq!(
            listing(&stage.join("opt")),
            ["dir", "file-then-dir", "keep.txt"]
        );
        assert_eq!(
            std::fs::read_to_string(stage.join("opt/dir/upper.txt")).expect("upper"),
            "upper ".repeat(1000)
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn layers_apply_in_order_with_whiteouts_and_opaque_directories() {
        let dir = temp("layers");
        let upper = gzip(&layer(&[
            E::File("opt/.wh.old", ""),
            E::File("opt/dir/upper.txt", "upper"),
            E::File("opt/dir/.wh..wh..opq", ""),
            E::File("opt/keep.txt", "changed"),
            E::Dir("opt/file-then-dir"),
            E::File("opt/file-then-dir/inside", "now a dir"),
        ]));
        oci_layout(&dir.join("image"), &[lower(), upper]);
        let stage = dir.join("stage");
        std::fs::create_dir_all(&stage).expect("stage");
        let config =
            unpack_image(&dir.join("image"), &stage, &dir.join("scratch")).expect("unpack");

        assert_eq!(
            listing(&stage.join("opt")),
            ["dir", "file-then-dir", "keep.txt"]
        );
        // The opaque marker came after this layer's own file: it stays.
        assert_eq!(listing(&stage.join("opt/dir")), ["upper.txt"]);
        assert_eq!(
            std::fs::read_to_string(stage.join("opt/keep.txt")).expect("kept"),
            "changed"
        );
        assert!(stage.join("opt/file-then-dir/inside").is_file());
        assert_eq!(config.env, ["PATH=/bin", "A=b"]);
        assert_eq!(config.working_dir.as_deref(), Some("/app"));
        assert_eq!(config.user.as_deref(), Some("app"));
        assert_eq!(config.entrypoint, ["/bin/sh", "-c"]);
        assert_eq!(config.cmd, ["echo hi"]);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_docker_save_archive_is_read_too() {
        let dir = temp("docker");
        let root = dir.join("saved");
        std::fs::create_dir_all(root.join("l1")).expect("dirs");
        std::fs::write(root.join("config.json"), CONFIG).expect("config");
        std::fs::write(root.join("l1/layer.tar"), lower()).expect("layer");
        std::fs::write(
            root.join("manifest.json"),
            r#"[{"Config":"config.json","RepoTags":["t:1"],"Layers":["l1/layer.tar"]}]"#,
        )
        .expect("manifest");
        // As `docker save` writes it: a tar of that tree.
        let mut b = tar::Builder::new(Vec::new());
        b.append_dir_all(".", &root).expect("tar");
        let archive = dir.join("saved.tar");
        std::fs::write(&archive, b.into_inner().expect("tar")).expect("archive");
        let stage = dir.join("stage");
        std::fs::create_dir_all(&stage).expect("stage");
        let config = unpack_image(&archive, &stage, &dir.join("scratch")).expect("unpack");

        assert_eq!(listing(&stage.join("opt/old")), ["gone.txt"]);
        assert_eq!(config.user.as_deref(), Some("app"));
        assert!(!dir.join("scratch").exists());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn hostile_images_are_refused_with_the_reason() {
        let dir = temp("hostile");
        let outside = dir.join("outside");
        std::fs::create_dir_all(&outside).expect("outside");
        std::fs::write(outside.join("victim"), "host file").expect("victim");
        let cases: Vec<(&str, Vec<Vec<u8>>, &str)> = vec![
            (
                "whiteout through a link",
                vec![
                    layer(&[E::Link("escape", outside.to_str().expect("utf-8"))]),
                    layer(&[E::File("escape/.wh.victim", "")]),
                ],
                "leads out of the image",
            ),
            (
                "absolute entry",
                vec![layer(&[E::File("ok", "")]), {
                    let mut l = layer(&[E::File("xetc/passwd", "root::0:0")]);
                    l[0] = b'/';
                    // The checksum covers the name: fix it.
                    l[148..156].copy_from_slice(b"        ");
                    let sum: u32 = l[..512].iter().map(|&b| u32::from(b)).sum();
                    l[148..156].copy_from_slice(format!("{sum:06o}\0 ").as_bytes());
                    l
                }],
                "absolute",
            ),
            (
                "zstd cut short",
                vec![{
                    let z = zstd(&lower(), 1 << 20);
                    z[..z.len() / 2].to_vec()
                }],
                "unreadable entry",
            ),
            (
                "zstd window of 1 GiB",
                // A frame header asking for a 1 GiB window (exponent 20).
                vec![vec![0x28, 0xb5, 0x2f, 0xfd, 0x00, 0xa0, 0, 0, 0, 0]],
                "window_size is too big",
            ),
        ];
        for (what, layers, expected) in cases {
            let image = dir.join(what.replace(' ', "-"));
            oci_layout(&image, &layers);
            let stage = image.with_extension("stage");
            std::fs::create_dir_all(&stage).expect("stage");
            let err = unpack_image(&image, &stage, &dir.join("scratch"))
                .expect_err(what)
                .to_string();
            assert!(err.contains(expected), "{what}: {err}");
        }
        assert_eq!(
            std::fs::read_to_string(outside.join("victim")).expect("victim"),
            "host file"
        );
        // A blob that is not what its digest says.
        let image = dir.join("tampered");
        oci_layout(&image, &[lower()]);
        let blob = std::fs::read_dir(image.join("blobs/sha256"))
            .expect("blobs")
            .map(|e| e.expect("entry").path())
            .find(|p| std::fs::metadata(p).map_or(0, |m| m.len()) == lower().len() as u64)
            .expect("the layer");
        let mut bytes = std::fs::read(&blob).expect("layer");
        // A file's content, so the tar reads well and only the digest tells.
        let at = bytes
            .windows(4)
            .position(|w| w == b"kept")
            .expect("content");
        bytes[at] ^= 1;
        std::fs::write(&blob, bytes).expect("tamper");
        let stage = dir.join("tampered-stage");
        std::fs::create_dir_all(&stage).expect("stage");
        let err = unpack_image(&image, &stage, &dir.join("scratch"))
            .expect_err("tampered")
            .to_string();
        assert!(err.contains("does not match its digest"), "{err}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
