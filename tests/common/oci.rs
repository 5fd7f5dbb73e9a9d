//! Container images the tests make themselves (no registry): tar layers
//! and OCI image layouts. Included by the tests that need it
//! (`#[path = "common/oci.rs"] mod oci;`).

#![allow(dead_code)]

use serde_json::json;

/// An entry of a test image's layer: path, content (None: a directory),
/// symlink target, mode, uid.
pub type LayerEntry<'a> = (&'a str, Option<&'a [u8]>, Option<&'a str>, u32, u64);

/// A tar layer of `entries`.
pub fn image_layer(entries: &[LayerEntry<'_>]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for (path, content, link, mode, uid) in entries {
        let mut h = tar::Header::new_gnu();
        h.set_uid(*uid);
        h.set_gid(*uid);
        h.set_mtime(1_700_000_000);
        h.set_mode(*mode);
        match (content, link) {
            (_, Some(target)) => {
                h.set_entry_type(tar::EntryType::Symlink);
                h.set_size(0);
                b.append_link(&mut h, path, target).expect("link");
            }
            (Some(data), None) => {
                h.set_entry_type(tar::EntryType::Regular);
                h.set_size(data.len() as u64);
                b.append_data(&mut h, path, *data).expect("file");
            }
            (None, None) => {
                h.set_entry_type(tar::EntryType::Directory);
                h.set_size(0);
                b.append_data(&mut h, path, &[][..]).expect("dir");
            }
        }
    }
    b.into_inner().expect("layer")
}

pub fn sha256_digest(bytes: &[u8]) -> String {
    use sha2::Digest;
    let hex: String = sha2::Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    format!("sha256:{hex}")
}

/// A one-layer OCI image layout (tar) named `name` (the name `ctr images
/// import` gives it), whose config is `config` (`Env`, `Entrypoint`...).
pub fn single_layer(name: &str, layer: &[LayerEntry<'_>], config: serde_json::Value) -> Vec<u8> {
    let layer = image_layer(layer);
    let config = json!({
        "architecture": "amd64",
        "os": "linux",
        "config": config,
        "rootfs": { "type": "layers", "diff_ids": [sha256_digest(&layer)] }
    });
    image(
        Some(name),
        &config,
        &[(&layer, "application/vnd.oci.image.layer.v1.tar")],
    )
}

/// An OCI image layout (tar) of one linux/amd64 manifest: the image
/// configuration document `config` and `layers` (bytes, media type), named
/// `name` for `ctr images import` if given.
pub fn image(name: Option<&str>, config: &serde_json::Value, layers: &[(&[u8], &str)]) -> Vec<u8> {
    let config = serde_json::to_vec(config).expect("config");
    let layer_list: Vec<serde_json::Value> = layers
        .iter()
        .map(|(bytes, media)| {
            json!({ "mediaType": media, "digest": sha256_digest(bytes), "size": bytes.len() })
        })
        .collect();
    let manifest = serde_json::to_vec(&json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {
            "mediaType": "application/vnd.oci.image.config.v1+json",
            "digest": sha256_digest(&config), "size": config.len()
        },
        "layers": layer_list
    }))
    .expect("manifest");
    let mut entry = json!({
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "digest": sha256_digest(&manifest), "size": manifest.len(),
        "platform": { "architecture": "amd64", "os": "linux" }
    });
    if let Some(name) = name {
        entry["annotations"] = json!({ "io.containerd.image.name": name });
    }
    let index =
        serde_json::to_vec(&json!({ "schemaVersion": 2, "manifests": [entry] })).expect("index");
    let mut blobs: Vec<&[u8]> = vec![&config, &manifest];
    blobs.extend(layers.iter().map(|(bytes, _)| *bytes));
    layout(&index, &blobs)
}

/// An OCI image layout as a tar archive: `index.json` and the blobs.
pub fn layout(index: &[u8], blobs: &[&[u8]]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    let mut add = |path: String, data: &[u8]| {
        let mut h = tar::Header::new_ustar();
        h.set_size(data.len() as u64);
        h.set_mode(0o644);
        h.set_uid(0);
        h.set_gid(0);
        h.set_mtime(1_700_000_000);
        b.append_data(&mut h, path, data).expect("entry");
    };
    add("oci-layout".into(), br#"{"imageLayoutVersion":"1.0.0"}"#);
    add("index.json".into(), index);
    for blob in blobs {
        add(format!("blobs/sha256/{}", &sha256_digest(blob)[7..]), blob);
    }
    b.into_inner().expect("image")
}
