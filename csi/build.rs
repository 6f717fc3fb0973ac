//! Generates the CSI messages and services from `proto/csi.proto` with a
//! pure-Rust proto compiler (protox): no protoc needed to build arbor.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/csi.proto");
    let fds = protox::compile(["csi.proto"], ["proto"])?;
    tonic_prost_build::configure().build_client(true).build_server(true).compile_fds(fds)?;
    Ok(())
}
