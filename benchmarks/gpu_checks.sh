#!/usr/bin/env bash
# The GPU checks of benchmarks/RESULTS.md as one script, for a lent CUDA machine whose python3 already holds
# torch and transformers (>= 5.6; webdataset and braceexpand travel as wheels in .whl/, made with `pip download
# --no-deps`, and a newer transformers may too; see the device notes). Logs go to ${OUT:-gpu-out}/.
# Each step has its own time limit so that one slow step cannot eat the others' time.
#   bash benchmarks/gpu_checks.sh                       # every step
#   bash benchmarks/gpu_checks.sh pytest_gpu train_step # the named steps only
set -u
only=" $* "
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
step() {  # step NAME SECONDS CMD...
    local name=$1 secs=$2; shift 2
    if [ "$only" != "  " ] && [[ "$only" != *" $name "* ]]; then return; fi
    echo "=== $name: $*" | tee -a "$OUT/summary.txt"
    local t0=$SECONDS
    timeout "$secs" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "--- $name rc=$rc in $((SECONDS - t0)) s" | tee -a "$OUT/summary.txt"
    tail -n 25 "$OUT/$name.log"
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/summary.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/summary.txt"
step pytest_gpu 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_equivalence.py tests/test_attention.py tests/test_remap.py
step equiv_varlen 60 python3 examples/check_equivalence.py --device cuda --dtype bfloat16 --attn varlen
step equiv_broken 60 python3 examples/check_equivalence.py --device cuda --dtype bfloat16 --attn varlen --mistake positions
step kernels 60 python3 benchmarks/bench_train_step.py --device cuda --kernels
step train_step 150 python3 benchmarks/bench_train_step.py --device cuda --backend torch_varlen --steps 3 --repeats 2
step sync_l2 60 python3 benchmarks/bench_train_step.py --device cuda --backend torch_varlen --sync-debug --layers 2
step sync_l8 60 python3 benchmarks/bench_train_step.py --device cuda --backend torch_varlen --sync-debug --layers 8
# this year's families (issue 31) in bf16 on the GPU: packed (varlen attention, token mixers isolated) vs the
# padded batch, and the controls that leave gated delta-net / short convolutions to transformers (must exit 1)
for fam in qwen3_5 qwen3_5_moe lfm2_vl glm4v_moe glm46v; do
    step "bf16_$fam" 90 python3 examples/check_equivalence.py --family "$fam" --device cuda --dtype bfloat16 --attn varlen --capacity 2048
done
# Gemma 4's image tokens attend both ways on its sliding layers: vlm-pack's masks through sdpa, not varlen
step bf16_gemma4 90 python3 examples/check_equivalence.py --family gemma4 --device cuda --dtype bfloat16 --attn sdpa --capacity 2048
for fam in qwen3_5 lfm2_vl; do
    step "leak_$fam" 90 python3 examples/check_equivalence.py --family "$fam" --device cuda --dtype bfloat16 --attn sdpa --capacity 2048 --mistake mixers
done
# video samples (issue 33) in bf16: videos alone, with images and text in one packed row, through varlen
# attention, against the padded batch; needs torchvision + av beside the machine's torch (carry their wheels in
# .whl/: torchvision built for that torch, e.g. 0.26.0 for torch 2.11, and av's cp312 wheel)
for fam in qwen2_vl qwen2_5_vl qwen3_vl qwen3_5 llava_onevision; do
    step "video_$fam" 120 python3 examples/check_equivalence.py --video --family "$fam" --device cuda --dtype bfloat16 --attn varlen
done
step video_broken_qwen2_5_vl 120 python3 examples/check_equivalence.py --video --family qwen2_5_vl --device cuda --dtype bfloat16 --attn varlen --mistake positions
# hybrid models (issue 40): the token mixers' kernel path (fla-core: pure Python + Triton, no compiled extension;
# carry its wheel and einops' in .whl/ where the machine cannot reach the registry), then models of released
# shapes, random-initialised, bf16, capacity 16384, images at real sizes: packed vs padded real tokens/s, their
# ratio to the padding bound, peak memory, first-step loss equal (exit 1 otherwise); Qwen3.5 on the kernels vs
# vlm-pack's per-sample loop. tests/test_bench_at_size.py runs the same script tiny on CPU.
step pytest_mixer_kernels 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_mixer_kernels.py
step fla_import 60 python3 -c "import torch, fla; print('fla', fla.__version__, torch.cuda.get_device_name())"
step at_size_qwen2_5_vl_3b 420 python3 benchmarks/bench_at_size.py --model qwen2_5_vl_3b --device cuda --capacity 16384 --checkpointing
step at_size_qwen3_5_2b_kernel 420 python3 benchmarks/bench_at_size.py --model qwen3_5_2b --device cuda --capacity 16384 --checkpointing --mixers kernel
step at_size_qwen3_5_2b_per_sample 420 python3 benchmarks/bench_at_size.py --model qwen3_5_2b --device cuda --capacity 16384 --checkpointing --mixers per_sample
