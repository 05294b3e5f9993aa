// The saved conversation of the Generate panel, in IndexedDB: one entry (the last XQuant
// conversation: its cache set's bytes, its text and tokens, the options it ran with).
// Every failure is a StoreError with a message a person can act on; the page keeps working.

const DB = 'xquant-demo';
const STORE = 'conversations';
const KEY = 'last';

export class StoreError extends Error {
  constructor(message, options) {
    super(message, options);
    this.name = 'StoreError';
  }
}

function request(r) {
  return new Promise((ok, fail) => {
    r.onsuccess = () => ok(r.result);
    r.onerror = () => fail(r.error);
  });
}

function open() {
  if (typeof indexedDB === 'undefined') return Promise.reject(new StoreError('this browser has no IndexedDB: the conversation cannot be kept'));
  const r = indexedDB.open(DB, 1);
  r.onupgradeneeded = () => r.result.createObjectStore(STORE);
  return request(r).catch((e) => {
    throw new StoreError(`IndexedDB did not open (${e?.name}: ${e?.message})`, { cause: e });
  });
}

async function withStore(mode, work) {
  const db = await open();
  try {
    const tx = db.transaction(STORE, mode);
    const done = new Promise((ok, fail) => {
      tx.oncomplete = ok;
      tx.onabort = tx.onerror = () => fail(tx.error);
    });
    const result = await request(work(tx.objectStore(STORE)));
    await done;
    return result;
  } finally {
    db.close();
  }
}

function explain(e, what) {
  if (e instanceof StoreError) return e;
  if (e?.name === 'QuotaExceededError') {
    return new StoreError(`not enough browser storage to ${what} (free some, or Forget the saved conversation)`, { cause: e });
  }
  return new StoreError(`could not ${what}: ${e?.name}: ${e?.message}`, { cause: e });
}

/** Checks an entry's shape; a damaged one throws StoreError. */
function check(entry) {
  const ok =
    entry && typeof entry === 'object' && entry.version === 1 &&
    entry.cache instanceof Uint8Array && entry.cache.byteLength > 0 &&
    typeof entry.text === 'string' && Array.isArray(entry.tokens) &&
    entry.tokens.every((t) => Number.isInteger(t) && t >= 0) &&
    entry.options && typeof entry.options === 'object';
  if (!ok) throw new StoreError('the saved conversation is damaged (Forget it to start afresh)');
  return entry;
}

/**
 * Saves `entry` ({ cache: Uint8Array, text, tokens, options, model, ... }), replacing the
 * last one.
 */
export async function saveConversation(entry) {
  const e = check({ version: 1, savedAt: Date.now(), ...entry });
  try {
    await withStore('readwrite', (s) => s.put(e, KEY));
  } catch (err) {
    throw explain(err, 'save the conversation');
  }
}

/** The saved conversation, or null when there is none; a damaged one throws StoreError. */
export async function loadConversation() {
  let entry;
  try {
    entry = await withStore('readonly', (s) => s.get(KEY));
  } catch (err) {
    throw explain(err, 'read the saved conversation');
  }
  return entry === undefined ? null : check(entry);
}

/** Deletes the saved conversation (none: nothing happens). */
export async function forgetConversation() {
  try {
    await withStore('readwrite', (s) => s.delete(KEY));
  } catch (err) {
    throw explain(err, 'forget the saved conversation');
  }
}
