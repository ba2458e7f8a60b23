"""Sluice's one import package.

The code lives in the repository's top-level folders (`engines/`, `infra/`, `tasks/`,
`flows/`); the entries of this folder are relative links to them, so everything Sluice
installs and imports sits under one name, `sluice.engines`, `sluice.infra`,
`sluice.tasks` and `sluice.flows`, which a user's own `tasks.py` or `engines/` cannot
shadow. Empty on purpose: importing `sluice` imports nothing else.
"""
