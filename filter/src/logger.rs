//! The filter's logger. kvgate's own records, info and above, go to Envoy's log (`wasm log
//! kvgate …`); other crates' only from warn up — the tokenizer describes every table it builds
//! at info, four lines per VM and model, which says nothing to an operator. A panic is logged
//! as critical before the VM aborts.

use proxy_wasm::hostcalls;
use proxy_wasm::types::LogLevel;

struct Logger;

static LOGGER: Logger = Logger;

/// Installs the logger and the panic hook; call once, when the VM starts.
pub fn install() {
    if log::set_logger(&LOGGER).is_ok() {
        log::set_max_level(log::LevelFilter::Info);
        std::panic::set_hook(Box::new(|panic| {
            let _ = hostcalls::log(LogLevel::Critical, &panic.to_string());
        }));
    }
}

/// Whether a record at `level` from `target` is written.
fn wanted(level: log::Level, target: &str) -> bool {
    level <= log::Level::Warn || (level <= log::Level::Info && target.starts_with("kvgate"))
}

impl log::Log for Logger {
    fn enabled(&self, metadata: &log::Metadata) -> bool {
        wanted(metadata.level(), metadata.target())
    }

    fn log(&self, record: &log::Record) {
        if !self.enabled(record.metadata()) {
            return;
        }
        let level = match record.level() {
            log::Level::Trace => LogLevel::Trace,
            log::Level::Debug => LogLevel::Debug,
            log::Level::Info => LogLevel::Info,
            log::Level::Warn => LogLevel::Warn,
            log::Level::Error => LogLevel::Error,
        };
        let _ = hostcalls::log(level, &record.args().to_string());
    }

    fn flush(&self) {}
}

#[cfg(test)]
mod tests {
    use super::wanted;
    use log::Level;

    #[test]
    fn libraries_speak_only_from_warn() {
        assert!(wanted(Level::Info, "kvgate_filter::root"));
        assert!(wanted(Level::Info, "kvgate_shared::prompt"));
        assert!(!wanted(Level::Debug, "kvgate_filter::http"));
        assert!(!wanted(Level::Info, "tk_encode::models::bpe"));
        assert!(wanted(Level::Warn, "tk_encode::models::bpe"));
        assert!(wanted(Level::Error, "anything"));
    }
}
