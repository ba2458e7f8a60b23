"""How the rollout role samples its prompt groups: one request per group (n = G, the
group's seed), a batch in one request at eta = 0, or G multi-turn episodes.

Rows are built here (`group_rows`) and written by the role, which knows the trainer
incarnation the weights came from.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sluice.engines.env.episodes import EpisodeSpec, Generate, run_group
from sluice.engines.rl.groups import sample_seed
from sluice.engines.rl.samples import group_rows
from sluice.engines.trajectory import TrajectoryRow
from sluice.infra.config.run import RunConfig
from sluice.infra.serving.client import InferenceClient
from sluice.tasks.prompts import PromptSource
from sluice.tasks.tool_runner import Shaping, ToolBox


class GroupSampler:
    """Samples prompt groups for one rollout role (`served_version`: what the servers
    hold now, the span of a response without tokens)."""

    def __init__(
        self,
        config: RunConfig,
        prompts: PromptSource,
        worker: str,
        served_version: Callable[[], int],
    ) -> None:
        self.config, self.prompts, self.worker = config, prompts, worker
        self.served_version = served_version
        self.episodes: EpisodeSpec | None = None  # multi-turn: set once the tokenizer is known
        self.toolbox: ToolBox | None = None
        self.shaping = Shaping(None)

    def sampling(self, index: int) -> dict[str, Any]:
        """The sampling params of prompt group `index`: its seed is the synchronous loop's
        for the same group (sample j of n = G draws with seed + j, Sluice's server rule),
        so at eta = 0 both sample the same tokens. SGLang reads `sampling_seed` only under
        --enable-deterministic-inference, and then gives all n samples that one seed."""
        cfg = self.config.rollout
        return {
            "max_new_tokens": cfg.max_new_tokens,
            "temperature": cfg.temperature,
            "top_p": cfg.top_p,
            "top_k": cfg.top_k,
            "stop_token_ids": list(self.prompts.stop_token_ids),
            "sampling_seed": sample_seed(self.config.seed, index, 0),
        }

    async def group(self, client: InferenceClient, index: int) -> list[TrajectoryRow]:
        row, prompt_ids = self.prompts.train_prompt(index, self.served_version())
        sampling = self.sampling(index)
        if self.episodes is not None:
            # A turn is a request of its own: one seed for every turn would draw each
            # turn's tokens from the same uniforms, so episodes sample unseeded.
            del sampling["sampling_seed"]
            return await self.episodes_of(client, index, row, prompt_ids, sampling)
        results = await client.generate_group(prompt_ids, self.config.rollout.group_size, sampling)
        worker, served = self.worker, self.served_version()
        return group_rows(index, row, prompt_ids, results, worker, version_if_empty=served)

    async def groups(
        self, client: InferenceClient, indices: list[int]
    ) -> list[list[TrajectoryRow]]:
        """The rows of prompt groups `indices` (one list per group), sampled in one request:
        a server schedules them as the synchronous loop's engine schedules a batch."""
        if len(indices) == 1:
            return [await self.group(client, indices[0])]
        prompts = [self.prompts.train_prompt(i, self.served_version()) for i in indices]
        results = await client.generate_groups(
            [ids for _, ids in prompts],
            self.config.rollout.group_size,
            [self.sampling(i) for i in indices],
        )
        worker, served = self.worker, self.served_version()
        return [
            group_rows(index, row, ids, group, worker, version_if_empty=served)
            for index, (row, ids), group in zip(indices, prompts, results, strict=True)
        ]

    async def episodes_of(
        self,
        client: InferenceClient,
        index: int,
        row: dict[str, Any],
        prompt_ids: list[int],
        sampling: dict[str, Any],
    ) -> list[TrajectoryRow]:
        """G multi-turn episodes of one prompt; each turn is one generate call that also
        stops at the call's closing token."""
        assert self.episodes is not None and self.toolbox is not None
        spec, tokenizer = self.episodes, self.prompts.tokenizer
        assert tokenizer is not None

        def sample(_j: int) -> Generate:
            async def turn(input_ids: list[int], max_new_tokens: int) -> Any:
                params = {
                    **sampling,
                    "max_new_tokens": max_new_tokens,
                    "stop_token_ids": [*sampling["stop_token_ids"], spec.close_token_id],
                }
                return await client.generate(input_ids, params)

            return turn

        episodes = await run_group(
            prompt_ids,
            self.config.rollout.group_size,
            spec,
            sample,
            self.toolbox,
            lambda text: list(tokenizer.encode(text, add_special_tokens=False)),
            lambda ids: str(tokenizer.decode(ids)),
        )
        shaping = [self.shaping(episode) for episode in episodes]
        worker, served = self.worker, self.served_version()
        return group_rows(
            index, row, prompt_ids, episodes, worker,
            shaping_rewards=shaping, version_if_empty=served,
        )  # fmt: skip
