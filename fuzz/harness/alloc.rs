//! Allocation accounting.

#![allow(unused_imports)]

use super::*;

/// Peak live bytes allowed while a file reader runs on an input of `len` bytes, per input
/// byte. The readers hold a value per element of JSON (`serde_json::Value`, 32 bytes) or
/// GGUF metadata (`Meta`, 32 bytes) whose smallest encoding is one or two bytes, so a few
/// tens of bytes per input byte are inherent; what the bound rules out is trusting a length
/// field.
pub const ALLOC_FACTOR: usize = 48;
/// The tokenizer's bound per byte of the text it encodes (the input as lossy UTF-8, up to
/// three times longer): BPE holds about 50 bytes per character of the piece it merges
/// (symbols, links, a heap of candidate pairs), besides its input, output and the harness's
/// copies.
pub const TOKENIZER_FACTOR: usize = 128;
/// The fixed part of the bound.
pub const ALLOC_SLACK: usize = 16 << 10;

/// The allocation bound of a file reader: `ALLOC_FACTOR × len + ALLOC_SLACK`.
pub fn alloc_limit(len: usize) -> usize {
    ALLOC_FACTOR * len + ALLOC_SLACK
}

/// A per-input time limit (release builds; the debug replay allows more).
pub const TIME_LIMIT: Duration = Duration::from_secs(1);

thread_local! {
    static TRACKING: Cell<bool> = const { Cell::new(false) };
    static LIVE: Cell<isize> = const { Cell::new(0) };
    static PEAK: Cell<isize> = const { Cell::new(0) };
    pub(crate) static PANIC_MSG: RefCell<Option<String>> = const { RefCell::new(None) };
}

pub(crate) fn account(delta: isize) {
    let _ = TRACKING.try_with(|t| {
        if t.get() {
            let live = LIVE.with(|l| {
                let v = l.get() + delta;
                l.set(v);
                v
            });
            PEAK.with(|p| p.set(p.get().max(live)));
        }
    });
}

/// The system allocator, counting the bytes of the thread that is measuring.
pub struct Counting;

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = System.alloc(layout);
        if !p.is_null() {
            account(layout.size() as isize);
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let p = System.alloc_zeroed(layout);
        if !p.is_null() {
            account(layout.size() as isize);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout);
        account(-(layout.size() as isize));
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // Old and new blocks may both be live while the contents move: count the new one
        // first, then release the old.
        let p = System.realloc(ptr, layout, new_size);
        if !p.is_null() {
            account(new_size as isize);
            account(-(layout.size() as isize));
        }
        p
    }
}

/// Runs `f`, returning its result and the peak of bytes allocated and not yet freed by this
/// thread while it ran.
pub fn measure<R>(f: impl FnOnce() -> R) -> (R, usize) {
    LIVE.with(|l| l.set(0));
    PEAK.with(|p| p.set(0));
    TRACKING.with(|t| t.set(true));
    let r = f();
    TRACKING.with(|t| t.set(false));
    (r, PEAK.with(|p| p.get()).max(0) as usize)
}

/// Installs (once) a panic hook that records the message and location of a panic inside a
/// measured target instead of printing it; other panics go to the default hook.
pub fn quiet_panics() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let default = panic::take_hook();
        panic::set_hook(Box::new(move |info| {
            if TRACKING.try_with(Cell::get).unwrap_or(false) {
                record_panic(info);
            } else {
                default(info);
            }
        }));
    });
}

pub(crate) fn record_panic(info: &panic::PanicHookInfo<'_>) {
    {
        let msg = info
            .payload()
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| info.payload().downcast_ref::<String>().cloned())
            .unwrap_or_default();
        let at = info
            .location()
            .map(|l| format!(" at {}:{}", l.file(), l.line()))
            .unwrap_or_default();
        let _ = PANIC_MSG.try_with(|m| *m.borrow_mut() = Some(format!("{msg}{at}")));
    }
}
