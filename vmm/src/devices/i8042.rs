//! Just enough of the i8042 keyboard controller for a guest to reset the
//! machine: Linux with `reboot=k` writes 0xfe (pulse reset line) to the
//! command port. husk treats that as "the guest is done".

use vmm_sys_util::eventfd::EventFd;

use super::bus::BusDevice;

/// Offset of the status/command port (0x64) from the data port (0x60).
const COMMAND_OFFSET: u64 = 4;
/// Command: pulse the CPU reset line.
const CMD_RESET_CPU: u8 = 0xfe;

/// The controller. Status reads say "no data, ready for input".
#[derive(Debug)]
pub struct I8042 {
    reset_evt: EventFd,
}

impl I8042 {
    /// Signals `reset_evt` when the guest asks for a reset.
    pub fn new(reset_evt: EventFd) -> Self {
        I8042 { reset_evt }
    }
}

impl BusDevice for I8042 {
    fn read(&mut self, _offset: u64, data: &mut [u8]) {
        data.fill(0);
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if offset == COMMAND_OFFSET && data.first() == Some(&CMD_RESET_CPU) {
            if let Err(e) = self.reset_evt.write(1) {
                tracing::error!("cannot signal the guest reset: {e}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reset_command_signals_the_event() {
        let evt = EventFd::new(libc::EFD_NONBLOCK).expect("eventfd");
        let mut dev = I8042::new(evt.try_clone().expect("clone"));

        dev.write(0, &[CMD_RESET_CPU]);
        assert!(evt.read().is_err(), "a data-port write is not a reset");
        dev.write(COMMAND_OFFSET, &[CMD_RESET_CPU]);

        assert_eq!(evt.read().expect("reset signalled"), 1);
    }
}
