//! Generates the Rust for `proto/` with protox (a protobuf compiler in Rust),
//! so building needs no system `protoc`, and the encoded descriptors that
//! gRPC server reflection serves.

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?).join("../../proto");
    let files =
        [root.join("inferrail/load/v1/load.proto"), root.join("inferrail/admin/v1/admin.proto"), root.join("inferrail/peer/v1/peer.proto")];
    for file in &files {
        println!("cargo:rerun-if-changed={}", file.display());
    }
    let descriptors = protox::compile(&files, [&root])?;
    // Each API's own descriptors, served by gRPC reflection where that API
    // is served, so that grpcurl needs no proto file and lists only what is there.
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    for (file, name) in files.iter().zip(["load", "admin"]) {
        let one = protox::compile([file], [&root])?;
        std::fs::write(out.join(format!("{name}.descriptors.bin")), prost::Message::encode_to_vec(&one))?;
    }
    tonic_prost_build::configure().build_client(true).build_server(true).compile_fds(descriptors)?;
    Ok(())
}
