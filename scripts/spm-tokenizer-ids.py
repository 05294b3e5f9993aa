#!/usr/bin/env python3
"""Token ids of a varied set of texts by Google's `sentencepiece` (pip install sentencepiece
protobuf), loading a model proto rebuilt from a GGUF's pieces, scores and types: an
independent check of the SentencePiece tokenizer in src/model/tokenizer/.

Usage: python3 scripts/spm-tokenizer-ids.py MODEL.gguf OUT.json
The proto: BPE, byte fallback, no dummy prefix, whitespace kept as it is (no normalization
rule: GGUF carries none, and llama.cpp applies none).
"""
import json
import sys

import sentencepiece as spm
from gguf import GGUFReader
from sentencepiece import sentencepiece_model_pb2 as pb

TEXTS = [
    "The Eiffel Tower is located in the city of",
    "Hello, world! How are you today?",
    "  two leading spaces, and   three inside.",
    "trailing spaces   ",
    "tabs\tand\t\ttwo tabs, a\nnewline, two\n\nand three\n\n\n.",
    "Numbers: 0 7 42 1234567890 3.14159 -273.15 1e-6 2026-12-02",
    "Ünïcödé: naïve café, Straße, Œuvre; Ελληνικά; русский текст.",
    "日本語のテキストと中文文本，한국어 텍스트。",
    "Emoji 😀👍🏽 and symbols ∑∫√∞ ≤ ≥ → ★ ♥",
    "<html><body><table><tr><td>cell</td></tr></table></body></html>",
    "<div class=\"note\"><p>Paragraph &amp; entity</p><br/></div>",
    "def f(x):\n    return x ** 2  # square\n\nfor i in range(10):\n\tprint(f(i))",
    "fn main() { let v: Vec<u32> = (0..8).map(|i| i * i).collect(); }",
    "Call me Ishmael. Some years ago—never mind how long precisely—having little or no money",
    "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n",
    "a\u0000b\u0007c\u001b[0m d",
    "   ",
    "\n",
    "x",
    "\u200b zero width and \u00a0 no-break space",
    "URL https://example.com/path?q=1&r=two#frag and e-mail a.b@c.org",
    "ALL CAPS and MiXeD cAsE and snake_case_name and camelCaseName",
    "Repeated: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa!!!!!!!!!!!!........",
]


def field(reader, key):
    f = reader.fields[key]
    return [f.parts[i] for i in f.data]


def main():
    reader = GGUFReader(sys.argv[1])
    pieces = [bytes(p).decode("utf-8") for p in field(reader, "tokenizer.ggml.tokens")]
    scores = [float(p[0]) for p in field(reader, "tokenizer.ggml.scores")]
    types = [int(p[0]) for p in field(reader, "tokenizer.ggml.token_type")]
    unk = int(reader.fields["tokenizer.ggml.unknown_token_id"].parts[-1][0])
    m = pb.ModelProto()
    m.trainer_spec.model_type = pb.TrainerSpec.BPE
    m.trainer_spec.byte_fallback = True
    m.trainer_spec.unk_id = unk
    m.normalizer_spec.name = "identity"
    m.normalizer_spec.add_dummy_prefix = False
    m.normalizer_spec.remove_extra_whitespaces = False
    m.normalizer_spec.escape_whitespaces = True
    for i, (p, s, t) in enumerate(zip(pieces, scores, types)):
        sp = m.pieces.add()
        sp.piece, sp.score = p, s
        sp.type = pb.ModelProto.SentencePiece.UNKNOWN if i == unk else t
    proc = spm.SentencePieceProcessor(model_proto=m.SerializeToString())
    cases = [{"text": t, "ids": proc.encode(t)} for t in TEXTS]
    with open(sys.argv[2], "w") as f:
        json.dump({"generator": "scripts/spm-tokenizer-ids.py (sentencepiece "
                   f"{spm.__version__})", "model": "gemma-3-270m-q4_k_m.gguf",
                   "cases": cases}, f, ensure_ascii=False, indent=0)
        f.write("\n")
    for c in cases[:3]:
        print(c["text"][:40], [pieces[i] for i in c["ids"]])


if __name__ == "__main__":
    main()
