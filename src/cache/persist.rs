//! Saving a conversation's cache to bytes and restoring it, on the same or another device.
//!
//! The container (little-endian throughout):
//!
//! ```text
//! magic    8 bytes  "XQCACHE\0"
//! version  u32      3 (versions 1 and 2 are read too)
//! kind     u32      1 = XQuant cache set, 2 = f16 cache set
//! length   u64      bytes of the body
//! body     length bytes (below)
//! checksum u64      FNV-1a (64-bit) of everything before it
//! ```
//!
//! Every body starts with the model (`layers`, `kv_heads`, `head_dim`, `batch`: u64 each).
//! Counts and lengths are u64; a blob is a u64 length and the buffer's bytes as stored on
//! the GPU (packed codes, params and f16 rings are saved as they are: nothing is
//! re-quantized or dequantized, so a restored set continues bit for bit like the original).
//!
//! XQuant body: plan JSON (blob), options (`max_ctx` u64, decode policy u8, output dtype u8,
//! `page_tokens` u64), the page size (u64), the *orphan* codes (codes a reuse layer still
//! shares from an anchor page that has since grown: count, blobs), then per layer its keys'
//! and values' store: `sink_len`, `len`, `quantized` (u64), the sink and window rings
//! (present u8, slots u64, blob), the pages (count; each: start, capacity, buffer blob,
//! fallback codes (present u8, blob), blocks (count; each: `t0`, `n`, shared u8, codes:
//! tag u8 = 0 a page's own section / 1 a page's fallback codes, then layer u64, K/V u8,
//! page u64; or tag 2, an orphan's index u64)).
//!
//! f16 body: `max_ctx` u64, output dtype u8, (version 2) each layer's attention window u64
//! (0: none), then per layer `len` u64, (version 2) the first position held u64, and, for
//! its keys and values, capacity u64, present u8, blob (a sliding layer's ring: token t in
//! slot `t % capacity`).
//!
//! Version 3 changed no field: a rotated plan's layer that has quantized no token yet holds
//! its sinks and window as they came (rotated from its first quantized group on); in
//! versions 1 and 2 they are always rotated. The f16 body of version 3 is version 2's.
//!
//! A sliding-window layer of an XQuant set needs no field of its own: its plan entry names
//! the window, its first page starts where the dropped ones ended (or, with none left, at
//! its quantized count), and its sink buffer is absent once the sinks fell out of it.
//!
//! Reading validates every field before anything is allocated (lengths are bounded by the
//! bytes that remain, so a corrupt length allocates nothing); restoring allocates and
//! uploads inside error scopes and returns a whole set or an error, its buffers freed.

use std::collections::HashMap;
use std::sync::Arc;

use crate::cache::config::{CacheOptions, DecodePolicy, ModelSpec};
use crate::cache::coordinator::Coordinator;
use crate::cache::fp16::{Fp16CacheSet, Fp16Layer, Fp16Store};
use crate::cache::io::{Growing, Scratch};
use crate::cache::kv_cache::KvCache;
use crate::cache::page::{max_page_tokens, BlockRecord, Page, PageKind};
use crate::cache::plan::{CachePlan, CodeSource};
use crate::cache::set::{page_kind, CacheSet, LayerCache};
use crate::cache::store::{sliding_page, Ring, TensorStore};
use crate::config::{DType, KvKind, TensorShape};
use crate::error::{Result, XqError};
use crate::gpu::{GpuBuffer, GpuContext, PackedCodes};
use crate::layout::GroupLayout;
use crate::reference::Role;

/// The first bytes of a saved cache.
pub const CACHE_MAGIC: [u8; 8] = *b"XQCACHE\0";
/// The container version this build writes (it reads this one and every earlier one).
pub const CACHE_VERSION: u32 = 3;

const HEADER: usize = 8 + 4 + 4 + 8;
const TRAILER: usize = 8;
/// Bound on each model dimension read from a file (far above any real model).
const MAX_DIM: usize = 1 << 24;
/// Bound on the elements of one group (rows × head_dim × group) read from a file.
const MAX_GROUP_ELEMENTS: u64 = 1 << 32;

/// Which cache a saved file holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SavedKind {
    /// An XQuant [`CacheSet`].
    XQuant,
    /// A plain [`Fp16CacheSet`].
    Fp16,
}

impl SavedKind {
    fn code(self) -> u32 {
        match self {
            SavedKind::XQuant => 1,
            SavedKind::Fp16 => 2,
        }
    }

    /// `xquant` or `fp16`.
    pub fn name(self) -> &'static str {
        match self {
            SavedKind::XQuant => "xquant",
            SavedKind::Fp16 => "fp16",
        }
    }
}

/// What a saved cache's header says: its kind and the model it was built for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SavedCache {
    /// XQuant or f16.
    pub kind: SavedKind,
    /// The model geometry.
    pub model: ModelSpec,
}

impl SavedCache {
    /// Reads a saved cache's kind and model, checking its magic, version, length and
    /// checksum (nothing is allocated).
    pub fn inspect(bytes: &[u8]) -> Result<SavedCache> {
        let (kind, _, body) = open(bytes)?;
        let model = Reader::new(body).model()?;
        Ok(SavedCache { kind, model })
    }

    /// Checks a saved cache completely without a GPU: everything restoring it checks
    /// (container, every field, pages, blocks and where their codes come from), for a device
    /// whose storage bindings and buffers hold at most `max_binding_bytes`
    /// ([`GpuContext::max_bound_buffer_bytes`]). `Ok` here means
    /// a restore on such a device fails only for want of memory or a lost device.
    pub fn validate(bytes: &[u8], max_binding_bytes: u64) -> Result<SavedCache> {
        let (kind, version, body) = open(bytes)?;
        let model = match kind {
            SavedKind::XQuant => parse_set(max_binding_bytes, body)?.model,
            SavedKind::Fp16 => parse_f16(version, body, max_binding_bytes)?.model,
        };
        Ok(SavedCache { kind, model })
    }

    /// A `FormatError` naming the first field where the cache's model differs from `model`.
    pub fn check_model(&self, model: &ModelSpec) -> Result<()> {
        check_model(&self.model, model)
    }
}

fn format_err(msg: impl std::fmt::Display) -> XqError {
    XqError::Format(format!("saved cache: {msg}"))
}

/// A `FormatError` naming the first field where `saved` differs from `want`.
fn check_model(saved: &ModelSpec, want: &ModelSpec) -> Result<()> {
    for (name, a, b) in [
        ("layers", saved.layers, want.layers),
        ("kv_heads", saved.kv_heads, want.kv_heads),
        ("head_dim", saved.head_dim, want.head_dim),
        ("batch", saved.batch, want.batch),
    ] {
        if a != b {
            return Err(format_err(format!(
                "it was saved for a model with {name} = {a}, not {b}"
            )));
        }
    }
    Ok(())
}

/// 64-bit FNV-1a.
fn fnv1a64(bytes: &[u8]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for &b in bytes {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

fn le_u32(b: &[u8]) -> u32 {
    u32::from_le_bytes([b[0], b[1], b[2], b[3]])
}

fn le_u64(b: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[..8]);
    u64::from_le_bytes(a)
}

/// Checks the container and returns its kind, version and body.
fn open(bytes: &[u8]) -> Result<(SavedKind, u32, &[u8])> {
    if bytes.is_empty() {
        return Err(format_err("no bytes (an empty file)"));
    }
    let n = bytes.len().min(CACHE_MAGIC.len());
    if bytes[..n] != CACHE_MAGIC[..n] {
        return Err(format_err("not a saved XQuant cache (wrong magic bytes)"));
    }
    if bytes.len() < HEADER {
        return Err(format_err(format!(
            "truncated: {} bytes, shorter than the {HEADER}-byte header",
            bytes.len()
        )));
    }
    let version = le_u32(&bytes[8..12]);
    if !(1..=CACHE_VERSION).contains(&version) {
        return Err(format_err(format!(
            "unsupported version {version} (this build reads versions 1 to {CACHE_VERSION})"
        )));
    }
    let kind = match le_u32(&bytes[12..16]) {
        1 => SavedKind::XQuant,
        2 => SavedKind::Fp16,
        k => return Err(format_err(format!("unknown cache kind {k}"))),
    };
    let body = le_u64(&bytes[16..24]);
    let want = body
        .checked_add((HEADER + TRAILER) as u64)
        .ok_or_else(|| format_err(format!("body length {body} is impossible")))?;
    let have = bytes.len() as u64;
    if have < want {
        return Err(format_err(format!(
            "truncated: {have} bytes, the header announces {want}"
        )));
    }
    if have > want {
        return Err(format_err(format!(
            "{} bytes after the end the header announces",
            have - want
        )));
    }
    let end = HEADER + body as usize;
    if fnv1a64(&bytes[..end]) != le_u64(&bytes[end..]) {
        return Err(format_err("checksum mismatch (the bytes are corrupt)"));
    }
    Ok((kind, version, &bytes[HEADER..end]))
}

/// A GPU range whose bytes go into the file at `at`.
struct Blob {
    at: usize,
    buffer: Arc<GpuBuffer>,
    offset: u64,
    len: u64,
}

/// The file being written: host fields now, GPU bytes once read back.
struct Writer {
    buf: Vec<u8>,
    blobs: Vec<Blob>,
}

impl Writer {
    fn new(kind: SavedKind) -> Self {
        let mut buf = Vec::with_capacity(4096);
        buf.extend_from_slice(&CACHE_MAGIC);
        buf.extend_from_slice(&CACHE_VERSION.to_le_bytes());
        buf.extend_from_slice(&kind.code().to_le_bytes());
        buf.extend_from_slice(&0u64.to_le_bytes());
        Writer {
            buf,
            blobs: Vec::new(),
        }
    }

    fn u8(&mut self, v: u8) {
        self.buf.push(v);
    }

    fn u64(&mut self, v: u64) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }

    fn usize(&mut self, v: usize) {
        self.u64(v as u64);
    }

    fn bytes(&mut self, b: &[u8]) {
        self.usize(b.len());
        self.buf.extend_from_slice(b);
    }

    fn model(&mut self, m: &ModelSpec) {
        for v in [m.layers, m.kv_heads, m.head_dim, m.batch] {
            self.usize(v);
        }
    }

    /// `len` bytes of `buffer` from `offset` (multiples of 4), read back later.
    fn blob(&mut self, buffer: &Arc<GpuBuffer>, offset: u64, len: u64) {
        self.u64(len);
        let at = self.buf.len();
        self.buf.resize(at + len as usize, 0);
        self.blobs.push(Blob {
            at,
            buffer: buffer.clone(),
            offset,
            len,
        });
    }

    /// An f16 ring of `tokens` slots: `len` bytes of `buffer` from `offset`.
    fn ring(&mut self, ring: Option<(&Arc<GpuBuffer>, usize, u64, u64)>) {
        match ring {
            Some((buffer, tokens, offset, len)) => {
                self.u8(1);
                self.usize(tokens);
                self.blob(buffer, offset, len);
            }
            None => self.u8(0),
        }
    }

    /// Records copying every blob into staging buffers.
    fn encode(self, ctx: &GpuContext, enc: &mut wgpu::CommandEncoder) -> SaveJob {
        let reads = self
            .blobs
            .iter()
            .filter(|b| b.len > 0)
            .map(|b| {
                let staging = ctx.encode_readback(enc, &b.buffer, b.offset, b.len);
                (b.at, b.len, staging)
            })
            .collect();
        SaveJob {
            bytes: self.buf,
            reads,
        }
    }
}

/// A save whose copies have been recorded: [`SaveJob::finish`] (once they are submitted)
/// maps them and returns the file.
pub struct SaveJob {
    bytes: Vec<u8>,
    reads: Vec<(usize, u64, wgpu::Buffer)>,
}

impl SaveJob {
    /// Reads the GPU bytes back (the submission recording them must have been made) and
    /// seals the file: body length and checksum.
    pub async fn finish(self, ctx: &GpuContext) -> Result<Vec<u8>> {
        let SaveJob { mut bytes, reads } = self;
        let mut reads = reads.into_iter();
        while let Some((at, len, staging)) = reads.next() {
            match ctx.map_staging(staging, len).await {
                Ok(data) => bytes[at..at + len as usize].copy_from_slice(&data),
                Err(e) => {
                    for (_, _, s) in reads {
                        s.destroy();
                    }
                    return Err(e);
                }
            }
        }
        let body = (bytes.len() - HEADER) as u64;
        bytes[16..24].copy_from_slice(&body.to_le_bytes());
        let sum = fnv1a64(&bytes);
        bytes.extend_from_slice(&sum.to_le_bytes());
        Ok(bytes)
    }
}

/// Reads fields, never past the end and never trusting a length beyond the bytes left.
struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn new(b: &'a [u8]) -> Self {
        Reader { b, at: 0 }
    }

    fn left(&self) -> usize {
        self.b.len() - self.at
    }

    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        if n > self.left() {
            return Err(format_err(format!(
                "{what}: needs {n} bytes at body offset {}, {} left",
                self.at,
                self.left()
            )));
        }
        let s = &self.b[self.at..self.at + n];
        self.at += n;
        Ok(s)
    }

    fn u8(&mut self, what: &str) -> Result<u8> {
        Ok(self.take(1, what)?[0])
    }

    fn flag(&mut self, what: &str) -> Result<bool> {
        match self.u8(what)? {
            0 => Ok(false),
            1 => Ok(true),
            v => Err(format_err(format!("{what}: flag {v} is neither 0 nor 1"))),
        }
    }

    fn usize(&mut self, what: &str) -> Result<usize> {
        let v = le_u64(self.take(8, what)?);
        usize::try_from(v).map_err(|_| format_err(format!("{what}: {v} is too large")))
    }

    /// A count of items of at least `min_bytes` each, bounded by the bytes left.
    fn count(&mut self, what: &str, min_bytes: usize) -> Result<usize> {
        let n = self.usize(what)?;
        if n > self.left() / min_bytes.max(1) {
            return Err(format_err(format!(
                "{what}: {n} items cannot fit in the {} bytes left",
                self.left()
            )));
        }
        Ok(n)
    }

    fn bytes(&mut self, what: &str) -> Result<&'a [u8]> {
        let n = self.usize(what)?;
        self.take(n, what)
    }

    fn model(&mut self) -> Result<ModelSpec> {
        let mut v = [0usize; 4];
        for (x, name) in v
            .iter_mut()
            .zip(["layers", "kv_heads", "head_dim", "batch"])
        {
            *x = self.usize(name)?;
            if *x == 0 || *x > MAX_DIM {
                return Err(format_err(format!("model {name} = {x} is out of range")));
            }
        }
        let m = ModelSpec {
            layers: v[0],
            kv_heads: v[1],
            head_dim: v[2],
            batch: v[3],
        };
        if m.batch.checked_mul(m.kv_heads).is_none_or(|r| r > MAX_DIM) {
            return Err(format_err("model batch × kv_heads is out of range"));
        }
        Ok(m)
    }

    fn dtype(&mut self) -> Result<DType> {
        match self.u8("output dtype")? {
            0 => Ok(DType::F32),
            1 => Ok(DType::F16),
            v => Err(format_err(format!("output dtype {v} is unknown"))),
        }
    }

    fn end(&self) -> Result<()> {
        match self.left() {
            0 => Ok(()),
            n => Err(format_err(format!(
                "{n} bytes left over after the last field"
            ))),
        }
    }
}

fn dtype_code(d: DType) -> u8 {
    match d {
        DType::F32 => 0,
        DType::F16 => 1,
    }
}

/// Bytes of an f16 ring of `tokens` slots: `[rows, tokens, stride]` halves.
fn ring_bytes(rows: usize, tokens: usize, stride: usize) -> Option<usize> {
    rows.checked_mul(tokens)?
        .checked_mul(stride)?
        .checked_mul(2)
}

/// Where a block's codes live, as saved.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum CodesRef {
    /// A page's own-codes section (`store` = layer × 2 + K/V).
    Own { store: usize, page: usize },
    /// A page's fallback codes.
    Fallback { store: usize, page: usize },
    /// Codes of no page any more (an anchor's page that grew since).
    Orphan(usize),
}

impl Writer {
    fn codes_ref(&mut self, r: CodesRef) {
        let (tag, store, page) = match r {
            CodesRef::Own { store, page } => (0, store, page),
            CodesRef::Fallback { store, page } => (1, store, page),
            CodesRef::Orphan(i) => {
                self.u8(2);
                self.usize(i);
                return;
            }
        };
        self.u8(tag);
        self.usize(store / 2);
        self.u8((store % 2) as u8);
        self.usize(page);
    }
}

impl Reader<'_> {
    fn codes_ref(&mut self) -> Result<CodesRef> {
        let tag = self.u8("block codes")?;
        if tag == 2 {
            return Ok(CodesRef::Orphan(self.usize("orphan index")?));
        }
        let layer = self.usize("codes layer")?;
        let kv = self.u8("codes K/V")?;
        let page = self.usize("codes page")?;
        if kv > 1 || layer > MAX_DIM {
            return Err(format_err(format!("block codes: layer {layer}, K/V {kv}")));
        }
        let store = layer * 2 + kv as usize;
        match tag {
            0 => Ok(CodesRef::Own { store, page }),
            1 => Ok(CodesRef::Fallback { store, page }),
            t => Err(format_err(format!("block codes: unknown tag {t}"))),
        }
    }
}

/// A saved cache of either kind, restored on `ctx` (see [`CacheSet::restore`]).
pub async fn restore_cache(ctx: Arc<GpuContext>, bytes: &[u8]) -> Result<Box<dyn KvCache>> {
    Ok(match SavedCache::inspect(bytes)?.kind {
        SavedKind::XQuant => Box::new(CacheSet::restore(ctx, bytes).await?),
        SavedKind::Fp16 => Box::new(Fp16CacheSet::restore(ctx, bytes).await?),
    })
}

/// Identity of a codes section: its buffer and offset.
fn codes_key(c: &PackedCodes) -> (usize, u64) {
    (Arc::as_ptr(&c.buffer) as usize, c.offset)
}

const KINDS: [KvKind; 2] = [KvKind::Key, KvKind::Value];

impl CacheSet {
    /// [`KvCache::encode_save`]: a set with the reference decode policy is refused
    /// (`ConfigError`): its coordinator holds codes in flight between layers.
    pub(super) fn save_job(&self, enc: &mut wgpu::CommandEncoder) -> Result<SaveJob> {
        if self.options.decode_policy == DecodePolicy::Reference {
            return Err(XqError::Config(
                "a cache set with the reference decode policy cannot be saved (its \
                 coordinator holds codes between layers); use the window policy"
                    .into(),
            ));
        }
        let mut w = Writer::new(SavedKind::XQuant);
        w.model(&self.model);
        w.bytes(self.plan.to_json().to_string().as_bytes());
        w.usize(self.options.max_ctx);
        w.u8(0);
        w.u8(dtype_code(self.options.output));
        w.usize(self.options.page_tokens);
        w.usize(self.max_page);
        // Every page's code sections, then the codes blocks hold that are none of them.
        let mut known = HashMap::new();
        for (li, l) in self.layers.iter().enumerate() {
            for (k, kv) in KINDS.iter().enumerate() {
                for (pi, p) in l.store(*kv).pages.iter().enumerate() {
                    let store = li * 2 + k;
                    if let Some(c) = &p.own_codes {
                        known.insert(codes_key(c), CodesRef::Own { store, page: pi });
                    }
                    if let Some(c) = &p.fallback_codes {
                        known.insert(codes_key(c), CodesRef::Fallback { store, page: pi });
                    }
                }
            }
        }
        let mut orphans: Vec<&PackedCodes> = Vec::new();
        for l in &self.layers {
            for kv in KINDS {
                for b in l.store(kv).pages.iter().flat_map(|p| &p.blocks) {
                    if let std::collections::hash_map::Entry::Vacant(e) =
                        known.entry(codes_key(&b.codes))
                    {
                        e.insert(CodesRef::Orphan(orphans.len()));
                        orphans.push(&b.codes);
                    }
                }
            }
        }
        w.usize(orphans.len());
        for c in orphans {
            w.blob(&c.buffer, c.offset, c.layout.code_bytes() as u64);
        }
        for l in &self.layers {
            for kv in KINDS {
                let s = l.store(kv);
                w.usize(s.sink_len);
                w.usize(s.len);
                w.usize(s.quantized);
                // The sinks and the window's slots, saved apart (the format of separate
                // buffers): a ring without window slots holds only sinks.
                let sb = s.slot_bytes();
                let held = s.sink_tokens() > 0;
                w.ring(s.ring.as_ref().filter(|_| held).map(|r| {
                    let len = (r.sinks * sb) as u64;
                    (&r.buffer, r.sinks, r.sink_offset(sb), len)
                }));
                w.ring(s.ring.as_ref().filter(|r| r.tokens > 0).map(|r| {
                    let len = (r.tokens * sb) as u64;
                    (&r.buffer, r.tokens, 0, len)
                }));
                w.usize(s.pages.len());
                for p in &s.pages {
                    w.usize(p.start);
                    w.usize(p.layout.tokens);
                    w.blob(&p.buffer, 0, p.buffer.size());
                    match &p.fallback_codes {
                        Some(c) => {
                            w.u8(1);
                            w.blob(&c.buffer, 0, c.buffer.size());
                        }
                        None => w.u8(0),
                    }
                    w.usize(p.blocks.len());
                    for b in &p.blocks {
                        w.usize(b.t0);
                        w.usize(b.n);
                        w.u8(b.shared as u8);
                        w.codes_ref(known[&codes_key(&b.codes)]);
                    }
                }
            }
        }
        Ok(w.encode(&self.ctx, enc))
    }

    /// A set restored from [`KvCache::save`]'s bytes on `ctx`: every field is validated
    /// before anything is allocated (`FormatError` for anything corrupt, truncated, of
    /// another version or kind, or that this device cannot bind), then buffers are
    /// allocated and uploaded inside error scopes. Either the whole set or an error (its
    /// buffers freed). Check the model with [`CacheSet::check_model`] (or
    /// [`SavedCache::inspect`] first).
    pub async fn restore(ctx: Arc<GpuContext>, bytes: &[u8]) -> Result<CacheSet> {
        ctx.check()?;
        let (kind, version, body) = open(bytes)?;
        if kind != SavedKind::XQuant {
            return Err(format_err(
                "it holds an f16 cache set, not an XQuant one (restore it as an f16 set)",
            ));
        }
        let saved = parse_set(ctx.max_bound_buffer_bytes(), body)?;
        let (set, submitted) = ctx.submit("restore cache set", |_| build_set(&ctx, saved, version));
        if let Err(e) = submitted.finish().await {
            return Err(ctx.lost_or(e));
        }
        set
    }

    /// A `FormatError` naming the first field where the set's model differs from `model`
    /// (a restored cache belongs to one model shape).
    pub fn check_model(&self, model: &ModelSpec) -> Result<()> {
        check_model(&self.model, model)
    }
}

struct SavedPage<'a> {
    start: usize,
    capacity: usize,
    buffer: &'a [u8],
    fallback: Option<&'a [u8]>,
    blocks: Vec<(usize, usize, bool, CodesRef)>,
}

struct SavedStore<'a> {
    kind: PageKind,
    sink_len: usize,
    len: usize,
    quantized: usize,
    sink: Option<(usize, &'a [u8])>,
    ring: Option<(usize, &'a [u8])>,
    pages: Vec<SavedPage<'a>>,
}

struct SavedSet<'a> {
    model: ModelSpec,
    plan: CachePlan,
    options: CacheOptions,
    max_page: usize,
    orphans: Vec<&'a [u8]>,
    /// Layer × 2 + K/V.
    stores: Vec<SavedStore<'a>>,
}

fn read_ring<'a>(r: &mut Reader<'a>, what: &str) -> Result<Option<(usize, &'a [u8])>> {
    if !r.flag(what)? {
        return Ok(None);
    }
    let tokens = r.usize(what)?;
    let data = r.bytes(what)?;
    Ok(Some((tokens, data)))
}

/// Reads and validates an XQuant body for a device binding at most `limit` bytes; allocates
/// nothing on the GPU.
fn parse_set(limit: u64, body: &[u8]) -> Result<SavedSet<'_>> {
    let mut r = Reader::new(body);
    let model = r.model()?;
    let json =
        std::str::from_utf8(r.bytes("plan")?).map_err(|_| format_err("the plan is not UTF-8"))?;
    let plan = CachePlan::from_json(json).map_err(|e| format_err(e.message()))?;
    plan.check_layers(model.layers)
        .map_err(|e| format_err(e.message()))?;
    plan.check_head_dim(model.head_dim)
        .map_err(|e| format_err(e.message()))?;
    let max_ctx = r.usize("max_ctx")?;
    let decode_policy = match r.u8("decode policy")? {
        0 => DecodePolicy::Window,
        v => return Err(format_err(format!("decode policy {v} is not saved"))),
    };
    let output = r.dtype()?;
    let page_tokens = r.usize("page_tokens")?;
    let options = CacheOptions {
        max_ctx,
        decode_policy,
        output,
        page_tokens,
    };
    options
        .validate(&plan)
        .map_err(|e| format_err(e.message()))?;
    let g = plan.group_quant_size;
    let max_page = r.usize("page size")?;
    if max_page < g || max_page % g != 0 || (page_tokens > 0 && max_page > page_tokens) {
        return Err(format_err(format!(
            "page size {max_page} is not a multiple of the group ({g}) within page_tokens"
        )));
    }
    // One group must be a sane size; then the page size this device allows is computed as
    // `for_plan` computes it, and the saved one must not exceed it.
    let group_elements = (model.rows() as u64)
        .checked_mul(model.head_dim as u64)
        .and_then(|e| e.checked_mul(g as u64));
    if group_elements.is_none_or(|e| e > MAX_GROUP_ELEMENTS.min(usize::MAX as u64 / 16)) {
        return Err(format_err("one group of the model is out of range"));
    }
    let kinds: Vec<PageKind> = plan
        .layers
        .iter()
        .flat_map(|l| KINDS.map(|kv| page_kind(&plan, &model, l, kv)))
        .collect();
    for k in &kinds {
        let fits = max_page_tokens(k, 0, limit).map_err(|e| format_err(e.message()))?;
        if max_page > fits {
            return Err(format_err(format!(
                "its pages of {max_page} tokens do not fit one storage binding of this device \
                 ({limit} bytes: at most {fits} tokens)"
            )));
        }
    }
    let n = r.count("orphan codes", 8)?;
    let orphans = (0..n)
        .map(|_| r.bytes("orphan codes"))
        .collect::<Result<Vec<_>>>()?;
    let stride = model.head_dim.div_ceil(2) * 2;
    let sinks = plan.sinks;
    let mut stores = Vec::with_capacity(kinds.len());
    for (i, kind) in kinds.iter().enumerate() {
        let attention_window = plan.layers[i / 2].attention_window;
        let sliding = attention_window.is_some();
        let store_page =
            attention_window.map_or(max_page, |a| sliding_page(max_page, a, plan.window, g));
        let name = format!(
            "layer {} {}",
            i / 2,
            if i % 2 == 0 { "keys" } else { "values" }
        );
        let err = |m: String| format_err(format!("{name}: {m}"));
        let sink_len = r.usize("sink tokens")?;
        let len = r.usize("tokens")?;
        let quantized = r.usize("quantized tokens")?;
        let sink = read_ring(&mut r, "sinks")?;
        let ring = read_ring(&mut r, "window")?;
        if sink_len > sinks || (len > 0 && sink_len < sinks) {
            return Err(err(format!("{sink_len} sink tokens of {sinks}")));
        }
        if quantized > len || quantized % g != 0 || sink_len + len > max_ctx {
            return Err(err(format!(
                "{quantized} quantized of {len} tokens (groups of {g}, max_ctx {max_ctx})"
            )));
        }
        match sink {
            Some((t, data))
                if t == sinks && ring_bytes(kind.rows, t, stride) == Some(data.len()) => {}
            Some(_) => return Err(err("the sink buffer does not match the sinks".into())),
            // A sliding layer drops its sinks once they fall out of its window.
            None if sink_len > 0 && !(sliding && sink_len == sinks) => {
                return Err(err("sink tokens without a sink buffer".into()))
            }
            None => {}
        }
        match ring {
            Some((t, data))
                if t >= 1
                    && len - quantized <= t
                    && ring_bytes(kind.rows, t, stride) == Some(data.len()) => {}
            Some(_) => return Err(err("the window ring does not match its tokens".into())),
            None if quantized < len => return Err(err("window tokens without a ring".into())),
            None => {}
        }
        let n_pages = r.count("pages", 33)?;
        let mut pages: Vec<SavedPage> = Vec::with_capacity(n_pages);
        let mut cursor = 0;
        for pi in 0..n_pages {
            let start = r.usize("page start")?;
            let capacity = r.usize("page capacity")?;
            let buffer = r.bytes("page buffer")?;
            let fallback = if r.flag("fallback codes")? {
                Some(r.bytes("fallback codes")?)
            } else {
                None
            };
            // A sliding layer's first page starts where what it dropped ends.
            let expected_start = match pages.last() {
                Some(p) => p.start + p.capacity,
                None if sliding && start % g == 0 && start <= quantized => start,
                None => 0,
            };
            if pi == 0 {
                cursor = expected_start;
            }
            if start != expected_start || capacity < g || capacity > store_page || capacity % g != 0
            {
                return Err(err(format!(
                    "page {pi} at {start} of {capacity} tokens does not follow the pages \
                     before it (page size {store_page})"
                )));
            }
            let layout = kind.layout(capacity).map_err(|e| err(e.message().into()))?;
            let page_bytes = kind
                .page_bytes(capacity)
                .map_err(|e| err(e.message().into()))?;
            if buffer.len() as u64 != page_bytes {
                return Err(err(format!(
                    "page {pi} holds {} bytes, not {page_bytes}",
                    buffer.len()
                )));
            }
            if let Some(f) = fallback {
                if kind.role != Role::Reuse || f.len() != layout.code_bytes().max(4) {
                    return Err(err(format!("page {pi}: fallback codes do not match")));
                }
            }
            let n_blocks = r.count("blocks", 26)?;
            let mut blocks = Vec::with_capacity(n_blocks);
            for _ in 0..n_blocks {
                let t0 = r.usize("block start")?;
                let n = r.usize("block tokens")?;
                let shared = r.flag("block shared")?;
                let codes = r.codes_ref()?;
                if n == 0 || t0 > capacity || n > capacity - t0 || start + t0 != cursor {
                    return Err(err(format!(
                        "page {pi}: block [{t0}, +{n}) does not continue the tokens before it"
                    )));
                }
                cursor += n;
                blocks.push((t0, n, shared, codes));
            }
            if blocks.is_empty() {
                return Err(err(format!("page {pi} holds no block")));
            }
            pages.push(SavedPage {
                start,
                capacity,
                buffer,
                fallback,
                blocks,
            });
        }
        if n_pages == 0 && sliding {
            // Every page dropped: quantization continues where they ended.
            cursor = quantized;
        }
        if cursor != quantized {
            return Err(err(format!(
                "its pages hold {cursor} tokens, not the {quantized} quantized"
            )));
        }
        stores.push(SavedStore {
            kind: *kind,
            sink_len,
            len,
            quantized,
            sink,
            ring,
            pages,
        });
    }
    r.end()?;
    let saved = SavedSet {
        model,
        plan,
        options,
        max_page,
        orphans,
        stores,
    };
    check_consistency(&saved)?;
    Ok(saved)
}

/// Keys and values in step; every block's codes exist, are laid out like its page and come
/// from where the plan says.
fn check_consistency(s: &SavedSet) -> Result<()> {
    let mut orphan_layouts: Vec<Option<GroupLayout>> = vec![None; s.orphans.len()];
    for (li, l) in s.plan.layers.iter().enumerate() {
        let (k, v) = (&s.stores[2 * li], &s.stores[2 * li + 1]);
        let step = |p: &SavedPage| {
            let blocks: Vec<_> = p.blocks.iter().map(|b| (b.0, b.1)).collect();
            (p.start, p.capacity, blocks)
        };
        if (k.sink_len, k.len, k.quantized) != (v.sink_len, v.len, v.quantized)
            || k.pages.len() != v.pages.len()
            || k.pages
                .iter()
                .zip(&v.pages)
                .any(|(a, b)| step(a) != step(b))
            || k.ring.map(|r| r.0) != v.ring.map(|r| r.0)
            || k.sink.is_some() != v.sink.is_some()
        {
            return Err(format_err(format!(
                "layer {li}: keys and values are out of step"
            )));
        }
        for (kvi, kv) in KINDS.iter().enumerate() {
            let this = 2 * li + kvi;
            let store = &s.stores[this];
            let source = match l.get(*kv).codes {
                CodeSource::Own => None,
                CodeSource::Layer(src) => Some(2 * src + kvi),
            };
            for (pi, p) in store.pages.iter().enumerate() {
                let layout = store
                    .kind
                    .layout(p.capacity)
                    .map_err(|e| format_err(e.message()))?;
                for &(_, _, shared, codes) in &p.blocks {
                    let bad = |m: &str| {
                        Err(format_err(format!(
                            "layer {li} {} page {pi}: a block's codes {m}",
                            if kvi == 0 { "keys" } else { "values" }
                        )))
                    };
                    if shared && source.is_none() {
                        return bad("are shared in a layer with codes of its own");
                    }
                    let (at, pg, fallback) = match codes {
                        CodesRef::Own { store, page } => (store, page, false),
                        CodesRef::Fallback { store, page } => (store, page, true),
                        CodesRef::Orphan(i) => {
                            let Some(slot) = orphan_layouts.get_mut(i) else {
                                return bad("name an orphan that does not exist");
                            };
                            if s.orphans[i].len() != layout.code_bytes() {
                                return bad("(orphan) are not laid out like the page");
                            }
                            match slot {
                                Some(l) if *l != layout => {
                                    return bad("(orphan) are laid out two ways");
                                }
                                _ => *slot = Some(layout),
                            }
                            continue;
                        }
                    };
                    let own_place = at == this && pg == pi;
                    let allowed = match (shared, fallback) {
                        (false, _) | (true, true) => own_place,
                        (true, false) => Some(at) == source,
                    };
                    if !allowed {
                        return bad("come from a page the plan does not allow");
                    }
                    let Some(target) = s
                        .stores
                        .get(at)
                        .and_then(|t| t.pages.get(pg).map(|p| (t, p)))
                    else {
                        return bad("name a page that does not exist");
                    };
                    let exists = match fallback {
                        true => target.1.fallback.is_some(),
                        false => target.0.kind.role == Role::Anchor,
                    };
                    let target_layout = target
                        .0
                        .kind
                        .layout(target.1.capacity)
                        .map_err(|e| format_err(e.message()))?;
                    if !exists || target_layout != layout {
                        return bad("are missing or not laid out like the page");
                    }
                }
            }
        }
    }
    Ok(())
}

/// An f16 ring on the GPU holding `data`.
/// The ring of a store with `sink_slots` sink slots from its saved window slots and sinks
/// (either may be absent: a ring holding only sinks, or a sliding layer's that dropped
/// them), each slot `slot_bytes`.
fn upload_ring(
    ctx: &GpuContext,
    window: Option<(usize, &[u8])>,
    sinks: Option<(usize, &[u8])>,
    sink_slots: usize,
    slot_bytes: usize,
) -> Result<Option<Ring>> {
    if window.is_none() && sinks.is_none() {
        return Ok(None);
    }
    let tokens = window.map_or(0, |(t, _)| t);
    let ring = Ring::new(ctx, "window", tokens, sink_slots, slot_bytes)?;
    if let Some((_, data)) = window {
        ctx.queue.write_buffer(&ring.buffer, 0, data);
    }
    if let Some((_, data)) = sinks {
        ctx.queue
            .write_buffer(&ring.buffer, ring.sink_offset(slot_bytes), data);
    }
    Ok(Some(ring))
}

/// Allocates and uploads a validated set of container `version` (inside the caller's error
/// scopes).
fn build_set(ctx: &Arc<GpuContext>, s: SavedSet, version: u32) -> Result<CacheSet> {
    let (window, sinks, max_ctx) = (s.plan.window, s.plan.sinks, s.options.max_ctx);
    let mut stores = Vec::with_capacity(s.stores.len());
    for saved in &s.stores {
        let attention_window = s.plan.layers[stores.len() / 2].attention_window;
        let mut st = TensorStore::new(saved.kind, s.max_page, window, sinks, max_ctx)
            .sliding(attention_window);
        st.ring = upload_ring(ctx, saved.ring, saved.sink, sinks, st.slot_bytes())?;
        // A sliding layer's sinks that fell out of its window were not saved.
        st.sinks_dropped = saved.sink.is_none() && saved.sink_len > 0;
        for p in &saved.pages {
            let mut page = Page::new(ctx, &saved.kind, p.start, p.capacity)?;
            if page.buffer.size() != p.buffer.len() as u64 {
                return Err(format_err("a page's size differs from this build's layout"));
            }
            ctx.queue.write_buffer(&page.buffer, 0, p.buffer);
            if let Some(data) = p.fallback {
                let l = page.layout;
                let shape = TensorShape::from_rows(l.rows, l.tokens, l.dim)?;
                let codes = ctx.empty_codes(l, &shape)?;
                if codes.buffer.size() != data.len() as u64 {
                    return Err(format_err("fallback codes differ from this build's layout"));
                }
                ctx.queue.write_buffer(&codes.buffer, 0, data);
                page.fallback_codes = Some(codes);
            }
            st.pages.push(page);
        }
        st.sink_len = saved.sink_len;
        st.len = saved.len;
        st.quantized = saved.quantized;
        // Before version 3 a rotated plan's sinks and window were rotated from the start.
        st.rotated = version < 3 || saved.quantized > 0;
        if attention_window.is_some() {
            st.dropped = saved.pages.first().map_or(saved.quantized, |p| p.start);
        }
        stores.push(st);
    }
    // Block records, now that every page exists: shared codes are the same `Arc`s as in the
    // pages they come from, as in the original.
    let mut orphans: Vec<Option<PackedCodes>> = vec![None; s.orphans.len()];
    for (i, saved) in s.stores.iter().enumerate() {
        for (pi, p) in saved.pages.iter().enumerate() {
            let layout = stores[i].pages[pi].layout;
            let mut records = Vec::with_capacity(p.blocks.len());
            for &(t0, n, shared, codes) in &p.blocks {
                let missing = || format_err("a block's codes are missing");
                let codes = match codes {
                    CodesRef::Own { store, page } => stores[store].pages[page]
                        .own_codes
                        .clone()
                        .ok_or_else(missing)?,
                    CodesRef::Fallback { store, page } => stores[store].pages[page]
                        .fallback_codes
                        .clone()
                        .ok_or_else(missing)?,
                    CodesRef::Orphan(o) => match &orphans[o] {
                        Some(c) => c.clone(),
                        None => {
                            let shape =
                                TensorShape::from_rows(layout.rows, layout.tokens, layout.dim)?;
                            let c = ctx.empty_codes(layout, &shape)?;
                            ctx.queue.write_buffer(&c.buffer, 0, s.orphans[o]);
                            orphans[o] = Some(c.clone());
                            c
                        }
                    },
                };
                records.push(BlockRecord {
                    t0,
                    n,
                    codes,
                    shared,
                });
            }
            stores[i].pages[pi].blocks = records;
        }
    }
    let mut it = stores.into_iter();
    let layers = s
        .plan
        .layers
        .iter()
        .map(|l| LayerCache {
            plan: *l,
            key: it.next().expect("two stores per layer"),
            value: it.next().expect("two stores per layer"),
        })
        .collect();
    Ok(CacheSet {
        ctx: ctx.clone(),
        model: s.model,
        coordinator: Coordinator::new(max_ctx),
        plan: s.plan,
        options: s.options,
        layers,
        scratch: Scratch::default(),
        partials: Growing::default(),
        rotated: Growing::default(),
        max_page: s.max_page,
    })
}

/// One side (keys or values) of a saved f16 layer: its capacity and bytes.
type SavedSide<'a> = (usize, Option<&'a [u8]>);

/// A validated f16 body.
struct SavedF16<'a> {
    model: ModelSpec,
    max_ctx: usize,
    output: DType,
    windows: Vec<Option<usize>>,
    /// Per layer: tokens, first position held, keys, values.
    layers: Vec<(usize, usize, SavedSide<'a>, SavedSide<'a>)>,
}

/// Reads and validates an f16 body of container `version` for a device binding at most
/// `limit` bytes; allocates nothing on the GPU.
fn parse_f16(version: u32, body: &[u8], limit: u64) -> Result<SavedF16<'_>> {
    let mut r = Reader::new(body);
    let model = r.model()?;
    let max_ctx = r.usize("max_ctx")?;
    let output = r.dtype()?;
    if max_ctx == 0 {
        return Err(format_err("max_ctx is 0"));
    }
    // Each layer takes at least its token count and two empty sides: a layer count the
    // bytes cannot hold allocates nothing.
    if model.layers > r.left() / (8 + 2 * 9) {
        return Err(format_err(format!(
            "{} layers cannot fit in the {} bytes left",
            model.layers,
            r.left()
        )));
    }
    let windows = match version {
        1 => vec![None; model.layers],
        _ => (0..model.layers)
            .map(|li| match r.usize("attention window")? {
                0 => Ok(None),
                w if w <= u32::MAX as usize => Ok(Some(w)),
                w => Err(format_err(format!("layer {li}: attention window {w}"))),
            })
            .collect::<Result<Vec<_>>>()?,
    };
    let rows = model.rows();
    let stride = model.head_dim.div_ceil(2) * 2;
    let mut layers = Vec::with_capacity(model.layers);
    for (li, window) in windows.iter().enumerate() {
        let len = r.usize("tokens")?;
        let held_from = match version {
            1 => 0,
            _ => r.usize("first position held")?,
        };
        let mut sides = Vec::with_capacity(2);
        for _ in 0..2 {
            let capacity = r.usize("capacity")?;
            let data = if r.flag("buffer")? {
                Some(r.bytes("buffer")?)
            } else {
                None
            };
            sides.push((capacity, data));
        }
        let (k, v) = (sides[0], sides[1]);
        // Every token, or a sliding layer's ring holding at least its window's.
        let holds = |cap: usize| match *window {
            None => held_from == 0 && cap >= len,
            Some(a) => held_from <= len - len.min(a) && cap >= len - held_from,
        };
        let ok = |(cap, data): SavedSide| match data {
            Some(d) => cap >= 1 && holds(cap) && ring_bytes(rows, cap, stride) == Some(d.len()),
            None => cap == 0 && len == 0,
        };
        if len > max_ctx || k.0 != v.0 || !ok(k) || !ok(v) {
            return Err(format_err(format!(
                "layer {li}: {len} tokens in buffers of {} and {} tokens do not match",
                k.0, v.0
            )));
        }
        if let Some(d) = k.1 {
            if d.len() as u64 > limit {
                return Err(format_err(format!(
                    "layer {li}: a buffer of {} bytes; this device binds at most {limit}",
                    d.len()
                )));
            }
        }
        layers.push((len, held_from, k, v));
    }
    r.end()?;
    Ok(SavedF16 {
        model,
        max_ctx,
        output,
        windows,
        layers,
    })
}

impl Fp16CacheSet {
    /// [`KvCache::encode_save`].
    pub(super) fn save_job(&self, enc: &mut wgpu::CommandEncoder) -> Result<SaveJob> {
        let mut w = Writer::new(SavedKind::Fp16);
        w.model(&self.model);
        w.usize(self.max_ctx);
        w.u8(dtype_code(self.output));
        for w_l in &self.windows {
            w.usize(w_l.unwrap_or(0));
        }
        for l in &self.layers {
            w.usize(l.len);
            w.usize(l.held_from);
            for s in [&l.key, &l.value] {
                w.usize(s.capacity);
                match &s.buffer {
                    Some(b) => {
                        w.u8(1);
                        w.blob(b, 0, b.size());
                    }
                    None => w.u8(0),
                }
            }
        }
        Ok(w.encode(&self.ctx, enc))
    }

    /// A set restored from [`KvCache::save`]'s bytes (validated as
    /// [`CacheSet::restore`] does).
    pub async fn restore(ctx: Arc<GpuContext>, bytes: &[u8]) -> Result<Fp16CacheSet> {
        ctx.check()?;
        let (kind, version, body) = open(bytes)?;
        if kind != SavedKind::Fp16 {
            return Err(format_err(
                "it holds an XQuant cache set, not an f16 one (restore it as an XQuant set)",
            ));
        }
        let SavedF16 {
            model,
            max_ctx,
            output,
            windows,
            layers: saved,
        } = parse_f16(version, body, ctx.max_bound_buffer_bytes())?;
        let build = |_: &mut wgpu::CommandEncoder| -> Result<Fp16CacheSet> {
            let mut layers = Vec::with_capacity(saved.len());
            for &(len, held_from, k, v) in &saved {
                let side = |(capacity, data): SavedSide| -> Result<Fp16Store> {
                    let buffer = match data {
                        Some(d) => {
                            let b = ctx.storage_buffer("f16 cache", d.len() as u64)?;
                            ctx.queue.write_buffer(&b, 0, d);
                            Some(b)
                        }
                        None => None,
                    };
                    Ok(Fp16Store { buffer, capacity })
                };
                layers.push(Fp16Layer {
                    key: side(k)?,
                    value: side(v)?,
                    len,
                    held_from,
                });
            }
            Ok(Fp16CacheSet {
                ctx: ctx.clone(),
                model,
                max_ctx,
                output,
                layers,
                windows: windows.clone(),
                scratch: Scratch::default(),
                partials: Growing::default(),
            })
        };
        let (set, submitted) = ctx.submit("restore f16 cache set", build);
        if let Err(e) = submitted.finish().await {
            return Err(ctx.lost_or(e));
        }
        set
    }

    /// A `FormatError` naming the first field where the set's model differs from `model`.
    pub fn check_model(&self, model: &ModelSpec) -> Result<()> {
        check_model(&self.model, model)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fnv_matches_the_published_vectors() {
        assert_eq!(fnv1a64(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a64(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a64(b"foobar"), 0x8594_4171_f739_67e8);
    }

    #[test]
    fn open_refuses_every_malformed_header() {
        let mut w = Writer::new(SavedKind::Fp16);
        w.u8(7);
        let mut good = w.buf.clone();
        good[16..24].copy_from_slice(&1u64.to_le_bytes());
        let sum = fnv1a64(&good);
        good.extend_from_slice(&sum.to_le_bytes());
        assert!(open(&good).is_ok());
        let bad = |b: &[u8]| matches!(open(b), Err(XqError::Format(_)));
        assert!(bad(&[]));
        for n in 0..good.len() {
            assert!(bad(&good[..n]), "truncated at {n}");
        }
        for i in 0..good.len() {
            let mut b = good.clone();
            b[i] ^= 0x10;
            assert!(bad(&b), "byte {i} flipped");
        }
        let mut long = good.clone();
        long.push(0);
        assert!(bad(&long));
    }
}
