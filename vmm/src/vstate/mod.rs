//! KVM state: the hypervisor handle, the VM, its memory and its vCPUs.

pub mod kvm;
pub mod memory;
pub mod vcpu;
pub mod vcpu_state;
pub mod vm;
