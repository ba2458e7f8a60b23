"""`sluice train --dry-run`: the resolved config and what the run would start, without
starting it.

The config is resolved and checked exactly as `sluice train` does (flows/cli.py), then
printed as YAML, followed by one row per process the run would start (the flow, the
role launcher, each role, the inference servers, the trainer's other ranks), each with
its torch threads (tasks/run/threads.py) and an estimate of the memory its model takes:
weights, gradients and optimizer state, the KV cache of an inference engine. The shape
comes from the model's config.json (the tiny model's from its config section); nothing
imports torch, Prefect or MLflow.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from sluice.infra.config.run import RunConfig
from sluice.infra.config.staleness import describe_mode
from sluice.infra.secrets import redact_config
from sluice.tasks.run.threads import role_threads

BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
LINEAR_DIMS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class ModelShape:
    """What the estimate needs of a Llama/Qwen2-style decoder (Hugging Face config.json names)."""

    source: str
    model_type: str
    hidden_size: int
    num_layers: int
    num_heads: int
    kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tied: bool
    attention_bias: bool
    max_positions: int

    def linear_dims(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each linear layer of one block."""
        h, q, kv, i = (
            self.hidden_size,
            self.num_heads * self.head_dim,
            self.kv_heads * self.head_dim,
            self.intermediate_size,
        )
        return {
            "q_proj": (h, q),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (q, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }

    @property
    def parameters(self) -> int:
        dims = self.linear_dims()
        block = sum(a * b for a, b in dims.values()) + 2 * self.hidden_size  # two norms
        if self.attention_bias:
            block += dims["q_proj"][1] + 2 * dims["k_proj"][1]
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tied else 2)
        return self.num_layers * block + embeddings + self.hidden_size  # final norm

    def lora_parameters(self, rank: int, modules: list[str]) -> int:
        dims = self.linear_dims()
        return self.num_layers * sum(rank * sum(dims[m]) for m in modules if m in dims)

    def describe(self) -> str:
        return (
            f"{self.parameters:,} parameters: {self.model_type}, {self.num_layers} layers, "
            f"hidden {self.hidden_size}, {self.kv_heads} kv heads x {self.head_dim}, "
            f"vocab {self.vocab_size} ({self.source})"
        )


def shape_from_hf(hf: dict[str, Any], source: str) -> ModelShape:
    heads = int(hf["num_attention_heads"])
    model_type = str(hf.get("model_type", "?"))
    return ModelShape(
        source=source,
        model_type=model_type,
        hidden_size=int(hf["hidden_size"]),
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=heads,
        kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(hf.get("head_dim") or hf["hidden_size"] // heads),
        intermediate_size=int(hf["intermediate_size"]),
        vocab_size=int(hf["vocab_size"]),
        tied=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=bool(hf.get("attention_bias", model_type == "qwen2")),
        max_positions=int(hf.get("max_position_embeddings") or 2048),
    )


def model_shape(config: RunConfig) -> ModelShape:
    """The policy's shape: `model.path`'s config.json, or the tiny model's config section
    (its character vocabulary as the shipped policy has it)."""
    if config.model.path:
        path = Path(config.model.path) / "config.json"
        return shape_from_hf(json.loads(path.read_text()), str(path))
    from sluice.engines.policy.shipped_policy import SHIPPED_DIR

    tiny = config.model.tiny
    vocab = json.loads((SHIPPED_DIR / "config.json").read_text())["vocab_size"]
    hf = {
        "model_type": tiny.arch,
        "hidden_size": tiny.hidden_size,
        "num_hidden_layers": tiny.num_layers,
        "num_attention_heads": tiny.num_heads,
        "intermediate_size": tiny.intermediate_size,
        "vocab_size": vocab,
        "tie_word_embeddings": True,
        "max_position_embeddings": tiny.max_position_embeddings,
    }
    return shape_from_hf(hf, "model.tiny")


def size(n_bytes: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if n_bytes >= scale:
            return f"{n_bytes / scale:.1f} {unit}"
    return f"{n_bytes / 2**10:.1f} KiB"


Terms = list[tuple[str, float]]


def trainer_terms(config: RunConfig, shape: ModelShape) -> Terms:
    """Memory of one trainer rank: weights, gradients and AdamW state (float32), plus
    what the settings add (a reference copy for the KL term, the checkpoint copy a
    background save holds)."""
    trainer, p = config.trainer, shape.parameters
    if trainer.backend == "megatron":
        split = trainer.tensor_parallel * trainer.pipeline_parallel
        mixed = trainer.dtype == "bfloat16"
        sharded = trainer.data_parallel if trainer.distributed_optimizer else 1
        terms = [
            (
                f"weights ({trainer.dtype}, 1/{split} of the model)",
                p / split * BYTES[trainer.dtype],
            ),
            (f"gradients ({trainer.dtype})", p / split * BYTES[trainer.dtype]),
            ("AdamW state (2 x float32)", p / split * 8 / sharded),
        ]
        if mixed:
            terms.append(("float32 main weights", p / split * 4 / sharded))
        return terms
    rank = trainer.lora.rank
    trainable = shape.lora_parameters(rank, trainer.lora.target_modules) if rank else p
    what = f"{trainable:,} adapter parameters" if rank else "float32"
    terms = [
        ("weights (float32)", p * 4.0),
        (f"gradients ({what})", trainable * 4.0),
        (f"AdamW state (2 x {what})", trainable * 8.0),
    ]
    if trainer.kl.coef > 0 and not rank:
        terms.append(("reference copy for the KL term", p * 4.0))
    if trainer.background_save and not rank:
        terms.append(("checkpoint copy while one is written (trainer.background_save)", p * 12.0))
    return terms


def engine_terms(config: RunConfig, shape: ModelShape) -> Terms:
    """Memory of one inference engine: weights in `rollout.dtype` and its KV cache,
    `max_batch_size` slots of `max_seq_len` tokens."""
    rollout = config.rollout
    width = BYTES[rollout.dtype]
    seq = rollout.max_seq_len or min(shape.max_positions, 2048)
    kv = (
        rollout.max_batch_size
        * seq
        * shape.num_layers
        * 2
        * shape.kv_heads
        * shape.head_dim
        * width
    )
    return [
        (f"weights ({rollout.dtype})", shape.parameters * float(width)),
        (
            f"KV cache ({rollout.max_batch_size} slots x {seq} tokens x {shape.num_layers} "
            f"layers x 2 x {shape.kv_heads} kv heads x {shape.head_dim} x {width} B)",
            float(kv),
        ),
    ]


Row = tuple[str, str, str, Terms | None, str]
"""process, count, torch threads, memory terms (None: no model), what it does."""


def server_rows(config: RunConfig, engine: Terms | None) -> list[Row]:
    servers, threads = config.servers, str(role_threads(config, "rollout"))
    if config.rollout.server_urls:
        n = len(config.rollout.server_urls)
        return [("inference servers", "0", "-", None, f"{n} given by rollout.server_urls")]
    if servers.launch == "embedded":
        device = (
            "a GPU if one is visible, else the CPU" if config.device == "auto" else config.device
        )
        what = f"child of rollout: Sluice's engine on {device}"
        return [("inference server", "1", threads, engine, what)]
    sglang = servers.engine == "sglang"
    gpus = f", {servers.gpus_per_server} GPU(s) each" if servers.gpus_per_server else ""
    kind = "containers" if servers.launch == "docker" else "Ray actors"
    what = f"{servers.engine} {kind}{gpus}" + (
        " (SGLang sizes its own KV cache: --mem-fraction-static)" if sglang else ""
    )
    server_threads = "-" if servers.gpus_per_server or sglang else threads
    return [("inference servers", str(servers.count), server_threads, engine, what)]


def reward_row(config: RunConfig) -> Row:
    reward, threads = config.reward, str(role_threads(config, "reward"))
    inline = reward.verifier == "builtin" and reward.num_workers == 1
    workers = "in the role's process" if inline else f"in {reward.num_workers} worker process(es)"
    sandbox = f"; code in the {reward.sandbox} sandbox" if reward.verifier == "code" else ""
    return ("reward", "1", threads, None, f"verifier {reward.verifier} {workers}{sandbox}")


def planned_rows(config: RunConfig, sync: bool, shape: ModelShape | None) -> list[Row]:
    """Every process the run would start, in the order it starts them (no memory
    estimates without the model's `shape`)."""
    trainer = engine = None
    if shape is not None:
        trainer, engine = trainer_terms(config, shape), engine_terms(config, shape)
    api = os.environ.get("PREFECT_API_URL") or "a temporary Prefect API"
    flow = "sluice-train-sync" if sync else "sluice-train"
    rows: list[Row] = [("sluice train", "1", "-", None, f"this command: flow {flow}, {api}")]
    minutes = config.model.supervised.minutes
    if minutes:
        full = None
        if shape is not None:  # every weight trains, whatever trainer.lora says
            p = shape.parameters
            full = [("weights, gradients and AdamW state (float32)", p * 16.0)]
        what = f"in this command, first: {minutes:g} min on the answers, its result version 0"
        rows.append(("supervised pass", "1", "-", full, what))
    if config.cluster.engine == "local":
        rows.append(("role launcher", "1", "-", None, "forks the roles with their imports done"))
    threads = {role: str(role_threads(config, role)) for role in ("sync", "train", "evaluate")}
    if sync:
        what = "generates, scores and trains in turn, on every core"
        both = None if trainer is None or engine is None else trainer + engine
        rows.append(("sync", "1", threads["sync"], both, what))
    else:
        what = "admits prompt groups under the staleness bound, writes rollouts/"
        rows.append(("rollout", "1", str(role_threads(config, "rollout")), None, what))
        rows += server_rows(config, engine)
        rows.append(reward_row(config))
        world = config.trainer.world_size
        what = f"{config.trainer.backend} backend, rank 0 of {world}"
        rows.append(("train", "1", threads["train"], trainer, what))
        if world > 1:
            rows.append(
                ("train ranks", str(world - 1), threads["train"], trainer, "spawned by rank 0")
            )
    user_tools = [tool for tool in config.episode.tools if ":" in tool]
    if user_tools:
        what = f"run {', '.join(user_tools)}"
        rows.append(("tool workers", str(config.episode.tool_workers), "-", None, what))
    if config.evaluation.during_run:
        every = config.evaluation.every
        what = "held-out reward of version 0, " + (
            f"every {every} versions and the last" if every else "and the last"
        )
        rows.append(("evaluate", "1", threads["evaluate"], engine, what))
    return rows


def dry_run_report(config: RunConfig, config_name: str, sync: bool, resume: str | None) -> str:
    """The resolved config as YAML, then the processes and their memory."""
    try:
        shape: ModelShape | None = model_shape(config)
        model = shape.describe()
    except (OSError, KeyError, ValueError) as err:  # a resumed run's model moved away
        shape, model = None, f"unknown ({type(err).__name__}: {err}), so no memory estimates"
    rows = planned_rows(config, sync, shape)
    kind = "synchronous colocated" if sync else "asynchronous"
    where = (
        "on this machine"
        if config.cluster.engine == "local"
        else f"on the Ray cluster at {config.cluster.address}"
    )
    source = f"run {resume}'s saved config" if resume else f"config {config_name}"
    lines = [
        f"# sluice train --dry-run: {source}, resolved and checked; nothing was started",
        yaml.safe_dump(redact_config(config.model_dump(mode="json")), sort_keys=False).rstrip(),
        "",
        f"Would start ({kind} run {where}; {os.cpu_count()} CPU cores here, device {config.device}):",
    ]
    if config.mode:
        lines.append(f"  {describe_mode(config)}")
    table = [("process", "count", "torch threads", "memory", "what")]
    table += [
        (name, count, threads, "-" if terms is None else size(sum(b for _, b in terms)), what)
        for name, count, threads, terms, what in rows
    ]
    widths = [max(len(row[i]) for row in table) for i in range(4)]
    lines += [
        "  " + "  ".join(c.ljust(w) for c, w in zip(row[:4], widths, strict=True)) + "  " + row[4]
        for row in table
    ]
    lines += [
        "",
        "Memory is an estimate per process: weights, gradients, optimizer state and KV cache",
        "only; activations, the allocator and Python come on top.",
        f"  model: {model}",
    ]
    names: dict[int, list[str]] = {}  # processes with the same estimate share a line
    for name, _, _, terms, _ in rows:
        if terms is not None:
            names.setdefault(id(terms), []).append(name)
    for name, _, _, terms, _ in rows:
        if terms is not None and names[id(terms)][0] == name:
            parts = " + ".join(f"{label} {size(n)}" for label, n in terms)
            lines.append(f"  {', '.join(names[id(terms)])}: {parts}")
    return "\n".join(lines)
