"""A Megatron-core ``GPTModel`` built from a Hugging Face policy directory.

The model runs Sluice's packed micro-batches as they are (sequences concatenated
without padding, positions restarting per sequence): they enter as Megatron's THD
layout with ``PackedSeqParams``, RoPE restarts at each sequence boundary, and core
attention is ``PackedDotProductAttention``, which runs the same per-sequence causal
attention as the torch backend (``sluice.engines.rl.batching.packed_causal_attention``).
Megatron's own local attention refuses packed input and its packed kernels need
Transformer Engine on a GPU.

Parallel state: ``initialize_parallel`` starts ``torch.distributed`` (gloo on a
CPU, NCCL on a GPU) if the process has not, then Megatron's model-parallel groups.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.transformer_config import TransformerConfig
from transformers import AutoConfig

from sluice.engines.inference.weights import read_weight_files
from sluice.engines.megatron import convert, cpu_shim
from sluice.engines.rl.batching import PackedBatch, packed_causal_attention


class PackedDotProductAttention(DotProductAttention):
    """Megatron's local core attention, plus packed (THD) sequences.

    With ``packed_seq_params`` the query is ``[T, heads, head_dim]`` and key/value
    ``[T, groups, head_dim]`` for all sequences of the micro-batch back to back;
    each sequence attends causally to itself only. Without it, Megatron's own code runs.
    """

    def forward(  # type: ignore[override]
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: Any = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> torch.Tensor:
        if packed_seq_params is None:
            return super().forward(
                query, key, value, attention_mask, attn_mask_type, attention_bias, None
            )
        scale = self.config.softmax_scale or self.config.kv_channels**-0.5
        out, _ = packed_causal_attention(
            self,
            query.transpose(0, 1)[None],
            key.transpose(0, 1)[None],
            value.transpose(0, 1)[None],
            None,
            scaling=scale,
            cu_seq_lens_q=packed_seq_params.cu_seqlens_q,
        )
        return out[0].reshape(out.shape[1], -1)


def initialize_parallel(tensor_parallel: int = 1, pipeline_parallel: int = 1) -> None:
    """Start torch.distributed (if needed) and Megatron's model-parallel groups.

    A process started without a launcher is a world of one; ``torchrun`` or another
    launcher sets ``WORLD_SIZE``, ``RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``.
    """
    cpu_shim.install()
    if not torch.distributed.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world == 1:
            # No rendezvous to do: an in-memory store, no port to pick or collide on.
            store = torch.distributed.HashStore()
            torch.distributed.init_process_group(backend, store=store, rank=0, world_size=1)
        else:  # MASTER_ADDR, MASTER_PORT and RANK come from the launcher
            rank = int(os.environ["RANK"])
            if torch.cuda.is_available():
                # One GPU per rank: rank r of a machine takes its GPU r, so tensor-parallel
                # ranks (adjacent in Megatron's order) share a node's fastest links.
                local = int(os.environ.get("LOCAL_RANK", rank))
                torch.cuda.set_device(local % torch.cuda.device_count())
            torch.distributed.init_process_group(backend, rank=rank, world_size=world)
    if parallel_state.model_parallel_is_initialized():
        if (
            parallel_state.get_tensor_model_parallel_world_size() == tensor_parallel
            and parallel_state.get_pipeline_model_parallel_world_size() == pipeline_parallel
        ):
            return
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_parallel, pipeline_parallel)


def build_gpt_model(
    hf_config: Any, *, params_dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> GPTModel:
    """A ``GPTModel`` shaped like ``hf_config`` for this rank (parallel state set), with
    random weights that ``load_hf_policy`` overwrites; the caller's RNG is left as it was."""
    with cpu_shim.cpu_only(), torch.random.fork_rng(devices=[]):
        return _build_gpt_model(hf_config, params_dtype, device)


def _build_gpt_model(hf_config: Any, params_dtype: torch.dtype, device: str) -> GPTModel:
    config = TransformerConfig(
        **convert.transformer_config_kwargs(hf_config),
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        use_cpu_initialization=True,
        # Packed micro-batches differ in token count, so stages send each other the
        # activation's shape before the activation.
        pipeline_dtype=params_dtype,
        variable_seq_lengths=parallel_state.get_pipeline_model_parallel_world_size() > 1,
        # The dense policies have no experts; the default (allgather) expert dispatcher
        # merely refuses variable lengths at config time.
        moe_token_dispatcher_type="alltoall",
        # Initialised before the HF weights overwrite it: the initialisers are also what
        # tags tensor-parallel weights as such (their grads count on every rank).
        perform_initialization=True,
    )
    spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=False)
    spec.submodules.self_attention.submodules.core_attention = PackedDotProductAttention
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        **convert.gpt_model_kwargs(
            hf_config, parallel_state.get_tensor_model_parallel_world_size()
        ),
    )
    pad_token_id = getattr(hf_config, "pad_token_id", None)
    if model.pre_process and pad_token_id is not None:
        model.embedding.word_embeddings.register_forward_hook(_padding_lookups_hook(pad_token_id))
    return model.to(device)


def _padding_lookups_hook(pad_token_id: int) -> Any:
    """A forward hook on the word embeddings: where the input is the pad token, the
    looked-up vector passes on its value but no gradient, as Hugging Face's
    ``nn.Embedding(padding_idx=pad_token_id)`` does.

    The torch backend trains the HF model, whose pad row never learns from its lookups
    (it still learns as the tied output row). A chat model may pad with a real token
    (SmolLM2 pads with ``<|im_end|>``, which ends every turn), so without this the two
    backends would update that row differently.
    """

    def hook(module: torch.nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> Any:
        input_ids = args[0]
        if output.shape[:-1] != input_ids.shape:  # sequence parallel scatters; unused here
            return None
        return torch.where((input_ids == pad_token_id)[..., None], output.detach(), output)

    return hook


def load_hf_policy(model_dir: str | Path, **kwargs: Any) -> tuple[GPTModel, Any]:
    """``(GPTModel, hf_config)`` with this rank's part of the HF directory's weights."""
    hf_config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    convert.check_supported(hf_config)
    convert.check_tensor_parallel(hf_config, parallel_state.get_tensor_model_parallel_world_size())
    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    convert.check_pipeline_parallel(hf_config, pp_size)
    model = build_gpt_model(hf_config, **kwargs)
    state = convert.hf_to_megatron(read_weight_files(model_dir), hf_config)
    if pp_size > 1:
        pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        state = convert.pipeline_stage(state, hf_config, pp_rank, pp_size)
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    if tp_size > 1:
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        state = convert.tensor_parallel_shard(state, hf_config, tp_rank, tp_size)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("._extra_state")]
    if missing or unexpected:
        raise ValueError(
            f"HF weights in {str(model_dir)!r} do not fill the Megatron model: "
            f"missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    return model, hf_config


def packed_logits(
    model: GPTModel, packed: PackedBatch, vocab_size: int | None = None
) -> torch.Tensor:
    """Logits ``[total_tokens, vocab_size]`` of a packed row, whole on every rank of the
    last pipeline stage; an earlier stage returns its output activations as they are
    (the pipeline schedule sends them on).

    With tensor parallelism each rank computes its slice of the (padded) vocabulary;
    the slices are gathered (the gather's backward hands each rank its slice of the
    gradient) and the padding columns are cut off.
    """
    cu = packed.cu_seqlens.to(torch.int32)
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        max_seqlen_q=packed.max_seqlen,
        max_seqlen_kv=packed.max_seqlen,
    )
    with cpu_shim.cpu_only():
        logits = model(
            packed.input_ids, packed.position_ids, attention_mask=None, packed_seq_params=params
        )
        if not parallel_state.is_pipeline_last_stage():
            return logits
        if parallel_state.get_tensor_model_parallel_world_size() > 1:
            logits = gather_from_tensor_model_parallel_region(logits)
    return logits[0, :, :vocab_size]
