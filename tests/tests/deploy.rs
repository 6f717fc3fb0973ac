//! The Kubernetes manifests in deploy/kubernetes: valid against the
//! published schemas of two Kubernetes versions (`kubernetes-validate
//! --strict`, offline) and consistent with each other and with `arbor csi`
//! (driver name, socket paths, volume attributes, secret keys), as
//! `deploy/validate.py` checks them.

use std::path::Path;
use std::process::Command;

fn tool_available() -> bool {
    let found = Command::new("kubernetes-validate").arg("--version").output().is_ok_and(|o| o.status.success());
    if !found {
        if std::env::var_os("CI").is_some() {
            panic!("kubernetes-validate must run in CI: pip install kubernetes-validate");
        }
        eprintln!("SKIPPED: kubernetes-validate is not installed (pip install kubernetes-validate)");
    }
    found
}

#[test]
fn the_manifests_validate_and_agree_with_the_plugin() {
    if !tool_available() {
        return;
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("workspace");
    let out = Command::new("python3").arg(root.join("deploy/validate.py")).output().expect("run deploy/validate.py");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    println!("{text}");
    assert!(out.status.success(), "deploy/validate.py found problems:\n{text}");
    assert!(text.contains("CSIDriver") && text.contains("DaemonSet") && text.contains("PersistentVolume"), "{text}");
}
