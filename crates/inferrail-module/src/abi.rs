//! Envoy 1.40's HTTP dynamic-module C ABI, bound by hand: the only place in
//! the project where `unsafe` is allowed.
//!
//! Two halves:
//! - the event hooks Envoy looks up in the module (`envoy_dynamic_module_on_*`):
//!   each turns its raw pointers into a [`Stream`] and the module's own
//!   [`Filter`], and runs the filter inside [`guard`], which catches a panic
//!   at the boundary and lets the request go on as if the module were not
//!   there (the cluster's own balancing picks the replica);
//! - the callbacks Envoy exports (`envoy_dynamic_module_callback_*`), used
//!   through [`Stream`]'s safe methods.
//!
//! Types follow Envoy 1.40's `abi.h`: buffers are a pointer and a length
//! passed by value, headers two buffers, enums C `int`s. Envoy calls every
//! hook of one HTTP stream on the same worker thread; a [`Stream`] is made
//! inside a hook and must not outlive it, which is why it is neither `Send`
//! nor kept. The [`Scheduler`] is the one handle other threads may use.
//!
//! The module's version string is [`ABI_VERSION`]. A different string only
//! makes Envoy warn; what makes an Envoy unfit is a callback it lacks, and
//! the module is linked with `-z now` so that such an Envoy refuses to load
//! it and names the symbol (`build.rs`).

use std::cell::Cell;
use std::ffi::{CStr, c_char, c_void};
use std::marker::PhantomData;
use std::panic::{AssertUnwindSafe, catch_unwind};

use crate::filter::{Body, Filter, Headers, Shared, Trailers};

/// Envoy 1.40's `ENVOY_DYNAMIC_MODULES_ABI_VERSION`, which Envoy compares
/// with what [`envoy_dynamic_module_on_program_init`] returns.
pub const ABI_VERSION: &CStr = c"v0.2.0";

/// `envoy_dynamic_module_type_{envoy,module}_buffer`: bytes owned by one side, lent to the other.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Buffer {
    ptr: *const c_char,
    len: usize,
}

impl Buffer {
    const EMPTY: Self = Self { ptr: std::ptr::null(), len: 0 };

    fn of(bytes: &[u8]) -> Self {
        Self { ptr: bytes.as_ptr().cast(), len: bytes.len() }
    }

    /// The bytes lent.
    ///
    /// # Safety
    /// `ptr` is null or valid for `len` bytes for as long as `'a`: Envoy's
    /// buffers are, until the hook returns or the same data is changed.
    unsafe fn bytes<'a>(self) -> &'a [u8] {
        if self.ptr.is_null() || self.len == 0 {
            return &[];
        }
        // SAFETY: the caller's promise.
        unsafe { std::slice::from_raw_parts(self.ptr.cast(), self.len) }
    }
}

/// `envoy_dynamic_module_type_{envoy,module}_http_header`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Header {
    key: Buffer,
    value: Buffer,
}

/// `envoy_dynamic_module_type_http_filter_envoy_ptr`.
type EnvoyFilter = *mut c_void;

/// `envoy_dynamic_module_type_http_header_type`.
const REQUEST_HEADERS: u32 = 0;
const RESPONSE_HEADERS: u32 = 2;
/// `envoy_dynamic_module_type_http_body_type`.
const RECEIVED_REQUEST_BODY: u32 = 0;
const BUFFERED_REQUEST_BODY: u32 = 1;
const RECEIVED_RESPONSE_BODY: u32 = 2;
/// `envoy_dynamic_module_type_attribute_id`: `upstream.address`, `ip:port`.
const UPSTREAM_ADDRESS: u32 = 41;
/// `envoy_dynamic_module_type_log_level`.
const LOG_INFO: u32 = 2;
const LOG_ERROR: u32 = 4;

unsafe extern "C" {
    fn envoy_dynamic_module_callback_http_get_headers_size(f: EnvoyFilter, kind: u32) -> usize;
    fn envoy_dynamic_module_callback_http_get_headers(f: EnvoyFilter, kind: u32, out: *mut Header) -> bool;
    fn envoy_dynamic_module_callback_http_get_header(
        f: EnvoyFilter,
        kind: u32,
        key: Buffer,
        out: *mut Buffer,
        index: usize,
        count: *mut usize,
    ) -> bool;
    fn envoy_dynamic_module_callback_http_set_header(f: EnvoyFilter, kind: u32, key: Buffer, value: Buffer) -> bool;
    fn envoy_dynamic_module_callback_http_get_body_chunks_size(f: EnvoyFilter, kind: u32) -> usize;
    fn envoy_dynamic_module_callback_http_get_body_chunks(f: EnvoyFilter, kind: u32, out: *mut Buffer) -> bool;
    fn envoy_dynamic_module_callback_http_get_body_size(f: EnvoyFilter, kind: u32) -> usize;
    fn envoy_dynamic_module_callback_http_received_buffered_request_body(f: EnvoyFilter) -> bool;
    fn envoy_dynamic_module_callback_http_drain_body(f: EnvoyFilter, kind: u32, bytes: usize) -> bool;
    fn envoy_dynamic_module_callback_http_append_body(f: EnvoyFilter, kind: u32, data: Buffer) -> bool;
    fn envoy_dynamic_module_callback_http_set_dynamic_metadata_string(f: EnvoyFilter, namespace: Buffer, key: Buffer, value: Buffer);
    fn envoy_dynamic_module_callback_http_send_response(
        f: EnvoyFilter,
        status: u32,
        headers: *const Header,
        headers_len: usize,
        body: Buffer,
        details: Buffer,
    );
    fn envoy_dynamic_module_callback_http_filter_continue_decoding(f: EnvoyFilter);
    fn envoy_dynamic_module_callback_http_filter_scheduler_new(f: EnvoyFilter) -> *mut c_void;
    fn envoy_dynamic_module_callback_http_filter_scheduler_commit(scheduler: *mut c_void, event: u64);
    fn envoy_dynamic_module_callback_http_filter_scheduler_delete(scheduler: *mut c_void);
    fn envoy_dynamic_module_callback_http_filter_get_attribute_string(f: EnvoyFilter, id: u32, out: *mut Buffer) -> bool;
    fn envoy_dynamic_module_callback_log(level: u32, message: Buffer);
}

/// Writes `message` to Envoy's log (its `dynamic_modules` logger).
pub fn log(error: bool, message: &str) {
    let level = if error { LOG_ERROR } else { LOG_INFO };
    // SAFETY: the message is borrowed for the call only.
    unsafe { envoy_dynamic_module_callback_log(level, Buffer::of(message.as_bytes())) }
}

/// One HTTP stream, as Envoy lends it to a hook: valid only during that hook.
pub struct Stream {
    ptr: EnvoyFilter,
    /// Neither `Send` nor `Sync`: the stream lives on its worker thread.
    _worker: PhantomData<*const ()>,
}

impl Stream {
    /// Every header of the request (pseudo-headers included), as (name, value).
    pub fn request_headers(&self) -> Vec<(String, String)> {
        // SAFETY: the stream is valid during the hook; `out` has room for the count Envoy gave.
        let headers = unsafe {
            let n = envoy_dynamic_module_callback_http_get_headers_size(self.ptr, REQUEST_HEADERS);
            let mut out = vec![Header { key: Buffer::EMPTY, value: Buffer::EMPTY }; n];
            if !envoy_dynamic_module_callback_http_get_headers(self.ptr, REQUEST_HEADERS, out.as_mut_ptr()) {
                return Vec::new();
            }
            out
        };
        let text = |b: Buffer| {
            // SAFETY: Envoy's header bytes, valid until the hook returns.
            String::from_utf8_lossy(unsafe { b.bytes() }).into_owned()
        };
        headers.into_iter().map(|h| (text(h.key), text(h.value))).collect()
    }

    /// A response header's first value.
    pub fn response_header(&self, key: &str) -> Option<String> {
        let mut out = Buffer::EMPTY;
        // SAFETY: valid stream; `out` is written by Envoy; no count asked for.
        let found = unsafe {
            envoy_dynamic_module_callback_http_get_header(
                self.ptr,
                RESPONSE_HEADERS,
                Buffer::of(key.as_bytes()),
                &mut out,
                0,
                std::ptr::null_mut(),
            )
        };
        // SAFETY: Envoy's bytes, valid until the hook returns.
        (found && !out.ptr.is_null()).then(|| String::from_utf8_lossy(unsafe { out.bytes() }).into_owned())
    }

    /// Sets (replacing) a request header.
    pub fn set_request_header(&self, key: &str, value: &str) {
        // SAFETY: valid stream; Envoy copies both buffers.
        unsafe {
            envoy_dynamic_module_callback_http_set_header(
                self.ptr,
                REQUEST_HEADERS,
                Buffer::of(key.as_bytes()),
                Buffer::of(value.as_bytes()),
            );
        }
    }

    /// Sets a string in the request's dynamic metadata.
    pub fn set_metadata(&self, namespace: &str, key: &str, value: &str) {
        // SAFETY: valid stream; Envoy copies the buffers.
        unsafe {
            envoy_dynamic_module_callback_http_set_dynamic_metadata_string(
                self.ptr,
                Buffer::of(namespace.as_bytes()),
                Buffer::of(key.as_bytes()),
                Buffer::of(value.as_bytes()),
            );
        }
    }

    fn chunks(&self, kind: u32, mut each: impl FnMut(&[u8])) {
        // SAFETY: valid stream; `out` has room for the count Envoy gave; the
        // chunks are Envoy's, read before the hook returns.
        unsafe {
            let n = envoy_dynamic_module_callback_http_get_body_chunks_size(self.ptr, kind);
            if n == 0 {
                return;
            }
            let mut out = vec![Buffer::EMPTY; n];
            if envoy_dynamic_module_callback_http_get_body_chunks(self.ptr, kind, out.as_mut_ptr()) {
                for chunk in out {
                    each(chunk.bytes());
                }
            }
        }
    }

    /// The whole request body, in the request-body hook that ends it: what
    /// Envoy buffered before, then the chunk it brings (which is the
    /// buffered body itself when an earlier filter had buffered it).
    pub fn request_body(&self) -> Vec<u8> {
        let mut body = Vec::new();
        // SAFETY: valid stream.
        if !unsafe { envoy_dynamic_module_callback_http_received_buffered_request_body(self.ptr) } {
            self.chunks(BUFFERED_REQUEST_BODY, |c| body.extend_from_slice(c));
        }
        self.chunks(RECEIVED_REQUEST_BODY, |c| body.extend_from_slice(c));
        body
    }

    /// Replaces the request body with `body`: in the request-body hook that
    /// ends it (`in_body_hook`), the chunk it brings holds the new body; after
    /// that hook, Envoy's buffer holds all of it.
    pub fn replace_request_body(&self, body: &[u8], in_body_hook: bool) {
        // SAFETY: valid stream; draining more than a buffer holds empties it; Envoy copies `body`.
        unsafe {
            let drain = |kind| {
                let n = envoy_dynamic_module_callback_http_get_body_size(self.ptr, kind);
                envoy_dynamic_module_callback_http_drain_body(self.ptr, kind, n);
            };
            let into = if in_body_hook && envoy_dynamic_module_callback_http_received_buffered_request_body(self.ptr) {
                RECEIVED_REQUEST_BODY
            } else if in_body_hook {
                drain(BUFFERED_REQUEST_BODY);
                RECEIVED_REQUEST_BODY
            } else {
                BUFFERED_REQUEST_BODY
            };
            drain(into);
            envoy_dynamic_module_callback_http_append_body(self.ptr, into, Buffer::of(body));
        }
        self.set_request_header("content-length", &body.len().to_string());
    }

    /// Calls `each` on every chunk of the response body this hook brings.
    pub fn response_chunks(&self, each: impl FnMut(&[u8])) {
        self.chunks(RECEIVED_RESPONSE_BODY, each);
    }

    /// The upstream host that answered, `ip:port`.
    pub fn upstream_address(&self) -> Option<String> {
        let mut out = Buffer::EMPTY;
        // SAFETY: valid stream; `out` is written by Envoy.
        let found = unsafe { envoy_dynamic_module_callback_http_filter_get_attribute_string(self.ptr, UPSTREAM_ADDRESS, &mut out) };
        // SAFETY: Envoy's bytes, valid until the hook returns.
        (found && !out.ptr.is_null()).then(|| String::from_utf8_lossy(unsafe { out.bytes() }).into_owned())
    }

    /// Answers the request locally; the hook then stops the chain.
    pub fn send_response(&self, status: u16, headers: &[(&str, &str)], body: &[u8], details: &str) {
        let headers: Vec<Header> =
            headers.iter().map(|(k, v)| Header { key: Buffer::of(k.as_bytes()), value: Buffer::of(v.as_bytes()) }).collect();
        // SAFETY: valid stream; Envoy copies headers, body and details.
        unsafe {
            envoy_dynamic_module_callback_http_send_response(
                self.ptr,
                u32::from(status),
                headers.as_ptr(),
                headers.len(),
                Buffer::of(body),
                Buffer::of(details.as_bytes()),
            );
        }
    }

    /// Lets the request go on after a hook stopped it.
    pub fn continue_decoding(&self) {
        // SAFETY: valid stream, on its worker thread (called from a hook).
        unsafe { envoy_dynamic_module_callback_http_filter_continue_decoding(self.ptr) }
    }

    /// A handle through which any thread asks Envoy to call this stream's
    /// `scheduled` hook on its worker.
    pub fn scheduler(&self) -> Scheduler {
        // SAFETY: valid stream, on its worker thread.
        Scheduler(unsafe { envoy_dynamic_module_callback_http_filter_scheduler_new(self.ptr) })
    }
}

/// Envoy's scheduler for one stream: [`Scheduler::commit`] from any thread
/// runs the stream's `scheduled` hook on its worker (or nothing, once the
/// stream is gone). Deleted when dropped.
pub struct Scheduler(*mut c_void);

// SAFETY: Envoy's scheduler is made for other threads: commit posts to the
// stream's dispatcher, and delete may follow from any thread. Callers keep
// commit and drop from racing (the filter holds it under a mutex).
unsafe impl Send for Scheduler {}
// SAFETY: as for Send; commit takes `&self` and Envoy serialises the posts.
unsafe impl Sync for Scheduler {}

impl Scheduler {
    /// Asks for the `scheduled` hook with `event`.
    pub fn commit(&self, event: u64) {
        // SAFETY: the scheduler is alive until dropped.
        unsafe { envoy_dynamic_module_callback_http_filter_scheduler_commit(self.0, event) }
    }
}

impl Drop for Scheduler {
    fn drop(&mut self) {
        // SAFETY: made by scheduler_new, deleted once.
        unsafe { envoy_dynamic_module_callback_http_filter_scheduler_delete(self.0) }
    }
}

/// The filter whose hook runs now on this worker, and what Envoy asked of
/// that filter from inside the hook: a local reply sent from the
/// `scheduled` hook, outside Envoy's own callbacks, may complete and
/// destroy the stream before the hook returns. Those wait for the hook's
/// end ([`guard_with`]), so no second `&mut` to the filter exists and it
/// is not freed under the one in use.
#[derive(Clone, Copy)]
struct Running {
    module: *const c_void,
    complete: bool,
    destroy: bool,
}

thread_local! {
    static RUNNING: Cell<Option<Running>> = const { Cell::new(None) };
}

/// Marks what Envoy asked of `module` if its hook is running on this
/// thread; whether it was (and the request now waits for the hook's end).
fn defer(module: *const c_void, mark: impl FnOnce(&mut Running)) -> bool {
    RUNNING.with(|running| match running.get() {
        Some(mut r) if r.module == module => {
            mark(&mut r);
            running.set(Some(r));
            true
        }
        _ => false,
    })
}

/// Runs `f` on the filter behind `module` and the stream behind `envoy`,
/// catching a panic: the filter then lets the request through unrouted
/// ([`Filter::fall_open`]) and the hook returns `fallback`. Also returns
/// whether the filter was destroyed during `f` (then neither it nor the
/// stream may be touched again).
///
/// # Safety
/// `module` is a pointer [`envoy_dynamic_module_on_http_filter_new`]
/// returned and not yet destroyed; `envoy` is the stream Envoy passed with it.
unsafe fn guard_with<T>(envoy: EnvoyFilter, module: *const c_void, fallback: T, f: impl FnOnce(&mut Filter, &Stream) -> T) -> (T, bool) {
    let stream = Stream { ptr: envoy, _worker: PhantomData };
    // SAFETY: the caller's promise; Envoy calls one stream's hooks one at a
    // time, and a hook it calls from inside this one is deferred (`defer`).
    let filter = unsafe { &mut *(module as *mut Filter) };
    let outer = RUNNING.with(|r| r.replace(Some(Running { module, complete: false, destroy: false })));
    let out = match catch_unwind(AssertUnwindSafe(|| f(filter, &stream))) {
        Ok(out) => out,
        Err(panic) => {
            let what = panic.downcast_ref::<&str>().copied().or_else(|| panic.downcast_ref::<String>().map(String::as_str));
            log(true, &format!("inferrail: a panic in the filter ({}); the request goes on unrouted", what.unwrap_or("?")));
            metrics::counter!("inferrail_module_panics_total").increment(1);
            // Marking the filter touches no state the panic may have left half done.
            filter.fall_open();
            fallback
        }
    };
    let asked = RUNNING.with(|r| r.replace(outer));
    if asked.is_some_and(|a| a.complete) {
        let _ = catch_unwind(AssertUnwindSafe(|| filter.complete()));
    }
    let destroyed = asked.is_some_and(|a| a.destroy);
    if destroyed {
        // SAFETY: made by Box::into_raw in filter_new; Envoy asked for its destruction once, during `f`.
        let filter = unsafe { Box::from_raw(module as *mut Filter) };
        let _ = catch_unwind(AssertUnwindSafe(move || drop(filter)));
    }
    (out, destroyed)
}

/// [`guard_with`], for hooks after which nothing touches the stream.
///
/// # Safety
/// As for [`guard_with`].
unsafe fn guard<T>(envoy: EnvoyFilter, module: *const c_void, fallback: T, f: impl FnOnce(&mut Filter, &Stream) -> T) -> T {
    // SAFETY: the caller's promise.
    unsafe { guard_with(envoy, module, fallback, f) }.0
}

/// Envoy loaded the module: the ABI version it was built for.
#[unsafe(no_mangle)]
pub extern "C" fn envoy_dynamic_module_on_program_init() -> *const c_char {
    ABI_VERSION.as_ptr()
}

/// A filter configuration: `config` is the routing YAML's path
/// ([`crate::process::routing_file`]). The first
/// one starts the process's router ([`Shared::start`]); null (Envoy then
/// rejects the configuration) when it cannot.
///
/// # Safety
/// Envoy passes buffers valid for the call.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_config_new(
    _config: *mut c_void,
    _name: Buffer,
    config: Buffer,
) -> *const c_void {
    // SAFETY: Envoy's buffer, valid for the call.
    let path = crate::process::routing_file(&String::from_utf8_lossy(unsafe { config.bytes() }));
    match catch_unwind(|| Shared::start(&path)) {
        Ok(Ok(shared)) => Box::into_raw(Box::new(shared)).cast_const().cast(),
        Ok(Err(e)) => {
            log(true, &format!("inferrail: {e}"));
            std::ptr::null()
        }
        Err(_) => {
            log(true, "inferrail: a panic while starting the router");
            std::ptr::null()
        }
    }
}

/// The configuration is gone (its filters are gone first).
///
/// # Safety
/// `config` came from [`envoy_dynamic_module_on_http_filter_config_new`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_config_destroy(config: *const c_void) {
    // SAFETY: made by Box::into_raw in config_new, destroyed once.
    let shared = unsafe { Box::from_raw(config as *mut Shared) };
    // A panic while dropping must not cross into Envoy.
    let _ = catch_unwind(AssertUnwindSafe(move || drop(shared)));
}

/// A new HTTP stream.
///
/// # Safety
/// `config` came from [`envoy_dynamic_module_on_http_filter_config_new`] and is alive.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_new(config: *const c_void, _envoy: EnvoyFilter) -> *const c_void {
    // SAFETY: the caller's promise.
    let shared = unsafe { &*(config as *const Shared) };
    match catch_unwind(AssertUnwindSafe(|| Box::new(Filter::new(shared.clone())))) {
        Ok(filter) => Box::into_raw(filter).cast_const().cast(),
        // Null: Envoy closes the stream.
        Err(_) => std::ptr::null(),
    }
}

/// The request's headers.
///
/// # Safety
/// Envoy's pointers for this stream ([`guard`]).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_request_headers(
    envoy: EnvoyFilter,
    module: *const c_void,
    end_of_stream: bool,
) -> u32 {
    // SAFETY: the caller's promise.
    unsafe { guard(envoy, module, Headers::Continue, |f, s| f.request_headers(s, end_of_stream)) as u32 }
}

/// A chunk of the request's body.
///
/// # Safety
/// Envoy's pointers for this stream ([`guard`]).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_request_body(
    envoy: EnvoyFilter,
    module: *const c_void,
    end_of_stream: bool,
) -> u32 {
    // SAFETY: the caller's promise.
    unsafe { guard(envoy, module, Body::Continue, |f, s| f.request_body(s, end_of_stream)) as u32 }
}

/// The request's trailers: they end a body that came before them.
///
/// # Safety
/// Envoy's pointers for this stream ([`guard`]).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_request_trailers(envoy: EnvoyFilter, module: *const c_void) -> u32 {
    // SAFETY: the caller's promise.
    unsafe { guard(envoy, module, Trailers::Continue, |f, s| f.request_trailers(s)) as u32 }
}

/// The response's headers.
///
/// # Safety
/// Envoy's pointers for this stream ([`guard`]).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_response_headers(
    envoy: EnvoyFilter,
    module: *const c_void,
    end_of_stream: bool,
) -> u32 {
    // SAFETY: the caller's promise.
    unsafe { guard(envoy, module, (), |f, s| f.response_headers(s, end_of_stream)) };
    Headers::Continue as u32
}

/// A chunk of the response's body.
///
/// # Safety
/// Envoy's pointers for this stream ([`guard`]).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_response_body(
    envoy: EnvoyFilter,
    module: *const c_void,
    end_of_stream: bool,
) -> u32 {
    // SAFETY: the caller's promise.
    unsafe { guard(envoy, module, (), |f, s| f.response_body(s, end_of_stream)) };
    Body::Continue as u32
}

/// The response's trailers.
///
/// # Safety
/// Envoy's pointers for this stream ([`guard`]).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_response_trailers(envoy: EnvoyFilter, module: *const c_void) -> u32 {
    // SAFETY: the caller's promise.
    unsafe { guard(envoy, module, (), |f, _| f.response_trailers()) };
    0
}

/// The stream is over, however it ended.
///
/// # Safety
/// Envoy's pointers for this stream ([`guard`]).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_stream_complete(envoy: EnvoyFilter, module: *const c_void) {
    if defer(module, |r| r.complete = true) {
        return;
    }
    // SAFETY: the caller's promise.
    unsafe { guard(envoy, module, (), |f, _| f.complete()) }
}

/// The stream's filter is destroyed.
///
/// # Safety
/// `module` came from [`envoy_dynamic_module_on_http_filter_new`], destroyed once.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_destroy(module: *const c_void) {
    if defer(module, |r| r.destroy = true) {
        return;
    }
    // SAFETY: made by Box::into_raw in filter_new.
    let filter = unsafe { Box::from_raw(module as *mut Filter) };
    // A panic while dropping must not cross into Envoy.
    let _ = catch_unwind(AssertUnwindSafe(move || drop(filter)));
}

/// A decision that went on the router's runtime is ready.
///
/// # Safety
/// Envoy's pointers for this stream ([`guard`]).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_scheduled(envoy: EnvoyFilter, module: *const c_void, _event: u64) {
    // SAFETY: the caller's promise. A panic lets the held request go on unrouted.
    let (go, destroyed) = unsafe { guard_with(envoy, module, true, |f, s| f.scheduled(s)) };
    if go && !destroyed {
        Stream { ptr: envoy, _worker: PhantomData }.continue_decoding();
    }
}

/// HTTP callouts: the module makes none.
#[unsafe(no_mangle)]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_callout_done(
    _envoy: EnvoyFilter,
    _module: *const c_void,
    _callout: u64,
    _result: u32,
    _headers: *const Header,
    _headers_len: usize,
    _body: *const Buffer,
    _body_len: usize,
) {
}

/// Streams the module opens: none.
#[unsafe(no_mangle)]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_headers(
    _envoy: EnvoyFilter,
    _module: *const c_void,
    _stream: u64,
    _headers: *const Header,
    _headers_len: usize,
    _end: bool,
) {
}

/// Streams the module opens: none.
#[unsafe(no_mangle)]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_data(
    _envoy: EnvoyFilter,
    _module: *const c_void,
    _stream: u64,
    _data: *const Buffer,
    _data_len: usize,
    _end: bool,
) {
}

/// Streams the module opens: none.
#[unsafe(no_mangle)]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_trailers(
    _envoy: EnvoyFilter,
    _module: *const c_void,
    _stream: u64,
    _trailers: *const Header,
    _trailers_len: usize,
) {
}

/// Streams the module opens: none.
#[unsafe(no_mangle)]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_complete(_envoy: EnvoyFilter, _module: *const c_void, _stream: u64) {}

/// Streams the module opens: none.
#[unsafe(no_mangle)]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_reset(
    _envoy: EnvoyFilter,
    _module: *const c_void,
    _stream: u64,
    _reason: u32,
) {
}

/// The client reads slowly: the module writes nothing to it.
#[unsafe(no_mangle)]
pub extern "C" fn envoy_dynamic_module_on_http_filter_downstream_above_write_buffer_high_watermark(
    _envoy: EnvoyFilter,
    _module: *const c_void,
) {
}

/// The client caught up.
#[unsafe(no_mangle)]
pub extern "C" fn envoy_dynamic_module_on_http_filter_downstream_below_write_buffer_low_watermark(
    _envoy: EnvoyFilter,
    _module: *const c_void,
) {
}
