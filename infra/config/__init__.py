"""A Sluice run's configuration: one pydantic model per section, one module per section.

Import what you need from its module (``from sluice.infra.config.run import load_config``);
this file exports nothing, so importing one section never loads the others. The keys, with
their types, defaults and docstrings, are listed in ``docs/config-reference.md``, which
``python -m sluice.infra.config.reference`` writes.

| module | holds |
|---|---|
| ``run`` | ``RunConfig`` (the top-level keys: ``name``, ``seed``, ``mode``, ``device``, ...), the checks that span sections, ``load_config`` and the built-in configs' folder |
| ``section`` | ``Section``, the base of every section: unknown keys are errors, docstrings are descriptions |
| ``model`` | ``model``: the policy, the embedded tiny model's shape, the supervised pass before RL |
| ``problem`` | ``problem``: the task, dataset, reasoning-gym and HumanEval settings, the curriculum |
| ``rollout`` | ``rollout``: sampling, group size, the embedded engine's slots, polling for new versions |
| ``episode`` | ``episode``: multi-turn episodes with tool calls |
| ``servers`` | ``servers``: inference servers the run starts itself, and the path weights take to them |
| ``staleness`` | ``staleness``: the bound on how far generation runs ahead; ``mode``, verl's named presets |
| ``reward`` | ``reward``: verifiers, the code sandbox, reward shaping |
| ``trainer`` | ``trainer``: optimisation, loss, rollout correction, advantages, LoRA, the watchdog |
| ``evaluation`` | ``evaluation``: held-out evaluation during and after a run |
| ``storage`` | ``storage``: where streams and checkpoints live, and how many versions are kept |
| ``checkpoint`` | ``checkpoint``: when a servable version becomes durable |
| ``tracking`` | ``tracking``: MLflow, the run's registered model and its aliases, model lines |
| ``cluster`` | ``cluster``: this machine or a Ray cluster, and what each role asks of its node |
| ``overrides`` | a config's raw mapping: reading YAML, ``--set`` overrides, ``ConfigError`` |
| ``peer_names`` | the names TRL and verl give Sluice's keys, accepted or refused as ``--set`` |
| ``reference`` | the generator of ``docs/config-reference.md`` |
"""
