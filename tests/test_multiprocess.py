"""Two processes (torch.distributed, gloo, CPU): balanced packs per rank, per-token loss == one process, padded.

Each rank trains on the packs ``balance_bins`` deals it (several micro-batches, unequal token counts), with
``PerTokenLoss`` over the world; the global loss and the summed gradients must equal a single process's
per-token loss and gradient over all samples in a padded batch (one sample per row, attention mask).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from vlm_pack import PackingCollator, PerTokenLoss, Preprocessor, balance_bins, pack, token_cross_entropy
from vlm_pack.collate.padded import pad_samples
from vlm_pack.demo import demo_records
from vlm_pack.offline import build_tokenizer, image_processor, tiny_model

CAPACITY = 1024
WORLD = 2


def _samples() -> tuple[list[dict[str, torch.Tensor]], object]:
    tok = build_tokenizer("qwen2_vl")
    ip = image_processor("qwen2_vl", size={"shortest_edge": 3136, "longest_edge": 25088})
    pre = Preprocessor(tok, ip)
    samples = [
        pre.process([data for data, _ in rec["images"]], rec["conversation"])
        for rec in demo_records(12)[2:]  # the first two are longer than CAPACITY
    ]
    return samples, tok


def _loss_sum(model, collator, samples) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of next-token losses of a packed micro-batch, and its number of loss tokens."""
    inputs = collator(samples).model_inputs("sdpa")
    labels = inputs.pop("labels")
    logits = model(**inputs).logits
    # Shift inside each row: every sample's first label is -100, so no sample predicts the next one.
    return token_cross_entropy(logits[:, :-1], labels[:, 1:])


def _rank_main(rank: int, tmpdir: str, samples, tok, bins, parts) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmpdir}/pg", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    model = tiny_model("qwen2_vl", tok, initializer_range=0.2).train()
    collator = PackingCollator(CAPACITY, model_config=model.config, tokenizer=tok)
    micro_batches = [[samples[i] for i in bins[b]] for b in parts[rank]]
    labels = [collator(mb).labels[:, 1:] for mb in micro_batches]
    ptl = PerTokenLoss(grad_reduction="sum")  # gradients are summed below with an all-reduce
    ptl.begin_step(sum(int((lab != -100).sum()) for lab in labels))
    for mb in micro_batches:
        ptl.loss_for_backward(*_loss_sum(model, collator, mb)).backward()
    loss = ptl.end_step()
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
    dist.all_reduce(grads, op=dist.ReduceOp.SUM)
    torch.save({"loss": loss, "grads": grads, "tokens": ptl.global_tokens}, os.path.join(tmpdir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.slow
def test_two_process_balanced_packs_match_single_process_loss(tmp_path):
    samples, tok = _samples()
    plan = pack([len(s["input_ids"]) for s in samples], CAPACITY)
    bins = [list(b) for b in plan.bins]
    parts = balance_bins(plan, WORLD)
    assert sorted(b for part in parts for b in part) == list(range(len(bins))) and all(parts)

    # fork: the children inherit the processed samples (no re-import, no pickling of tensors).
    mp.start_processes(_rank_main, args=(str(tmp_path), samples, tok, bins, parts), nprocs=WORLD,
                       start_method="fork")
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]

    # One process, unpacked: padded rows with an attention mask, per-token mean over all samples.
    model = tiny_model("qwen2_vl", tok, initializer_range=0.2).train()
    inputs = pad_samples(samples, pad_token_id=tok.pad_token_id)
    labels = torch.nn.utils.rnn.pad_sequence([s["labels"] for s in samples], batch_first=True, padding_value=-100)
    loss_sum, n = token_cross_entropy(model(**inputs, use_cache=False).logits[:, :-1], labels[:, 1:])
    (loss_sum / n).backward()
    ref_grads = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])

    for res in results:
        assert res["tokens"] == int(n)
        assert abs(float(res["loss"]) - float(loss_sum.detach() / n)) < 1e-5
        assert torch.allclose(res["grads"], ref_grads, rtol=1e-4, atol=1e-6)
    # The ranks hold unequal numbers of loss tokens, so a mean of per-rank means would weight tokens unequally:
    # the match above is the per-token reduction at work, not a coincidence of equal shares.
    per_rank = [sum(int((samples[i]["labels"][1:] != -100).sum()) for b in part for i in bins[b]) for part in parts]
    assert sum(per_rank) == int(n) and per_rank[0] != per_rank[1]
