//! KVM state: the VM (its fds, guest memory slots, the I/O ring in the stolen region and
//! the devices on its port bus), the vCPU run loop, the guest's CPUID table and the run's
//! watchdog.

pub mod cpuid;
pub mod memory;
pub mod vcpu;
pub mod vm;
pub mod watchdog;
