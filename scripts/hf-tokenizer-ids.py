# Token ids of texts by HuggingFace `tokenizers` (pip install tokenizers), built from a GGUF's
# vocabulary and merges with SmolLM2's pre-tokenizers: an independent check of src/model/tokenizer.rs.
# Usage: python3 scripts/hf-tokenizer-ids.py MODEL.gguf TEXTS.json
import struct, sys, json
from tokenizers import Tokenizer, models, pre_tokenizers, decoders
f=open(sys.argv[1],'rb')
def r(fmt): return struct.unpack('<'+fmt, f.read(struct.calcsize('<'+fmt)))[0]
def rs(): n=r('Q'); return f.read(n).decode('utf-8')
assert f.read(4)==b'GGUF'; ver=r('I'); nt=r('Q'); nkv=r('Q')
T={0:'B',1:'b',2:'H',3:'h',4:'I',5:'i',6:'f',7:'?',10:'Q',11:'q',12:'d'}
def val(t):
    if t==8: return rs()
    if t==9:
        at=r('I'); n=r('Q'); return [val(at) for _ in range(n)]
    return r(T[t])
meta={}
for _ in range(nkv):
    k=rs(); t=r('I'); meta[k]=val(t)
toks=meta['tokenizer.ggml.tokens']; merges=meta['tokenizer.ggml.merges']; types=meta['tokenizer.ggml.token_type']
vocab={t:i for i,t in enumerate(toks)}
bpe=models.BPE(vocab, [tuple(m.split(' ',1)) for m in merges])
tk=Tokenizer(bpe)
tk.pre_tokenizer=pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
tk.decoder=decoders.ByteLevel()
texts=json.load(open(sys.argv[2]))
print(json.dumps([tk.encode(t).ids for t in texts]))
