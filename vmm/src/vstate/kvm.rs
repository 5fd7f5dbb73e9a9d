//! Opening `/dev/kvm` and checking that it can run a husk guest.

use std::path::{Path, PathBuf};

use kvm_ioctls::{Cap, Kvm};

/// KVM API version every supported kernel reports.
const KVM_API_VERSION: i32 = 12;

/// Capabilities a guest boot cannot do without.
const REQUIRED_CAPS: &[(Cap, &str)] = &[
    (Cap::Irqchip, "KVM_CAP_IRQCHIP"),
    (Cap::UserMemory, "KVM_CAP_USER_MEMORY"),
    (Cap::SetTssAddr, "KVM_CAP_SET_TSS_ADDR"),
    (Cap::Ioeventfd, "KVM_CAP_IOEVENTFD"),
    (Cap::Irqfd, "KVM_CAP_IRQFD"),
    (Cap::ExtCpuid, "KVM_CAP_EXT_CPUID"),
];

/// Errors opening or checking KVM. The messages say what to do.
#[derive(Debug, thiserror::Error)]
pub enum KvmError {
    #[error("{0} does not exist: this host has no KVM; load kvm_intel or kvm_amd, or run on a machine with virtualization enabled")]
    NoDevice(PathBuf),
    #[error("permission denied opening {0}: add your user to the group that owns it (usually `kvm`) or run as root")]
    PermissionDenied(PathBuf),
    #[error("cannot open {0}: {1}")]
    Open(PathBuf, #[source] kvm_ioctls::Error),
    #[error("{path} reports KVM API version {found}, husk needs {KVM_API_VERSION}")]
    ApiVersion { path: PathBuf, found: i32 },
    #[error("KVM lacks {0}, which husk needs; upgrade the host kernel")]
    MissingCapability(&'static str),
    #[error("KVM supports at most {max} vCPUs per VM, {requested} were requested")]
    TooManyVcpus { requested: u8, max: usize },
}

/// Opens the KVM device at `path` and checks the API version and the
/// capabilities husk relies on.
pub fn open_kvm(path: &Path) -> Result<Kvm, KvmError> {
    let c_path = std::ffi::CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|_| KvmError::NoDevice(path.to_owned()))?;
    let kvm = Kvm::new_with_path(c_path).map_err(|e| match e.errno() {
        libc::ENOENT => KvmError::NoDevice(path.to_owned()),
        libc::EACCES | libc::EPERM => KvmError::PermissionDenied(path.to_owned()),
        _ => KvmError::Open(path.to_owned(), e),
    })?;
    let found = kvm.get_api_version();
    if found != KVM_API_VERSION {
        return Err(KvmError::ApiVersion {
            path: path.to_owned(),
            found,
        });
    }
    for (cap, name) in REQUIRED_CAPS {
        if !kvm.check_extension(*cap) {
            return Err(KvmError::MissingCapability(name));
        }
    }
    Ok(kvm)
}

/// Checks that KVM can run `vcpus` vCPUs in one VM.
pub fn check_vcpu_count(kvm: &Kvm, vcpus: u8) -> Result<(), KvmError> {
    let max = kvm.get_max_vcpus();
    if usize::from(vcpus) > max {
        return Err(KvmError::TooManyVcpus {
            requested: vcpus,
            max,
        });
    }
    Ok(())
}

/// Whether the host serves `/dev/kvm` through the PVM module, whose guests
/// need the kernel command-line flags of shared/platform.md.
pub use husk_vmm_api::cmdline::is_pvm_host;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_device_is_named_in_the_error() {
        let err = open_kvm(Path::new("/nonexistent/kvm")).expect_err("no device");

        assert!(matches!(err, KvmError::NoDevice(_)));
        assert!(err.to_string().contains("/nonexistent/kvm"));
    }

    #[test]
    fn a_file_that_is_not_kvm_is_refused() {
        let err = open_kvm(Path::new("/dev/null")).expect_err("not kvm");

        assert!(matches!(
            err,
            KvmError::Open(..) | KvmError::ApiVersion { .. }
        ));
    }
}
