//! Also makes `cargo test` build the `arbor` binary the end-to-end tests run.

#[test]
fn version_names_the_package_version() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_arbor")).arg("--version").output().expect("run arbor");
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains(env!("CARGO_PKG_VERSION")));
}
