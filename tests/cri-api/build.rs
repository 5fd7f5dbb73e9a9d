//! Generates the CRI client from `proto/api.proto` (Kubernetes' cri-api,
//! runtime.v1, Apache-2.0) with the protoc this crate depends on.

fn main() {
    let protoc = protoc_bin_vendored::protoc_bin_path().expect("a vendored protoc for this host");
    // SAFETY: the build script is single-threaded here.
    unsafe { std::env::set_var("PROTOC", protoc) };
    println!("cargo:rerun-if-changed=proto/api.proto");
    tonic_prost_build::configure()
        .build_server(false)
        .compile_protos(&["proto/api.proto"], &["proto"])
        .expect("compile the CRI protocol");
}
