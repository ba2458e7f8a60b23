"""Every config key is read by some code: a key nobody reads is a promise nobody keeps.

A static walk: for each leaf of the `RunConfig` schema, the code outside
`infra/config/run.py` (`RunConfig` and its checks across sections) must read it, as
`.section.key`, as an alias of its section (`t = config.trainer` ... `t.key` in the
same module), or by handing the whole section
to a function (`**config.trainer.loss.model_dump()`, which fails on a key the
function does not take), which a section type may do itself for all its instances
(`RolePlacement.ray_options` hands `self.model_dump()` to `ray.remote`).
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

from pydantic import BaseModel

from sluice.infra.config.overrides import REMOVED_KEYS, RENAMED_KEYS
from sluice.infra.config.run import RunConfig

ROOT = Path(__file__).resolve().parents[2]
CODE_DIRS = ("engines", "infra", "tasks", "flows")


def leaf_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    keys = []
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            keys.extend(leaf_keys(annotation, f"{prefix}{name}."))
        else:
            keys.append(f"{prefix}{name}")
    return keys


def section_type(key: str, root: type[BaseModel]) -> type[BaseModel]:
    """The model class of the section of `root` that holds `key`'s leaf."""
    model = root
    for name in key.split(".")[:-1]:
        annotation = model.model_fields[name].annotation
        assert isinstance(annotation, type) and issubclass(annotation, BaseModel)
        model = annotation
    return model


def hands_itself_whole(model: type[BaseModel]) -> bool:
    """Whether the section type's own code passes all of its fields on at once."""
    source = inspect.getsource(model)
    return "self.model_dump()" in source


def is_read(key: str, modules: list[str], root: type[BaseModel] = RunConfig) -> bool:
    *sections, leaf = key.split(".")
    if sections and hands_itself_whole(section_type(key, root)):
        return True
    if not sections:  # top level: config.seed, cfg.device, self.config.workdir
        return any(re.search(rf"\b(config|cfg)\.{leaf}\b", m) for m in modules)
    parent = sections[-1]
    for module in modules:
        if re.search(rf"\.{parent}\.{leaf}\b", module):
            return True
        if re.search(rf"\.{parent}\.model_dump\(", module):
            return True
        alias = re.search(rf"\b(\w+) = [\w.]*\.{parent}\s*$", module, re.M)
        if alias and re.search(rf"\b{alias.group(1)}\.{leaf}\b", module):
            return True
    return False


def code_modules() -> list[str]:
    return [
        path.read_text()
        for folder in CODE_DIRS
        for path in sorted((ROOT / folder).rglob("*.py"))
        if path != ROOT / "infra" / "config" / "run.py"
    ]


def test_every_config_key_is_read_by_some_code():
    modules = code_modules()
    unread = [key for key in leaf_keys(RunConfig) if not is_read(key, modules)]
    assert unread == [], f"config keys no code reads: {unread}"


def test_the_check_finds_an_unread_key():
    class Section(BaseModel):
        used: int = 1
        forgotten: int = 2

    class Config(BaseModel):
        section: Section = Section()

    modules = ["def f(config):\n    return config.section.used\n"]
    unread = [k for k in leaf_keys(Config) if not is_read(k, modules, Config)]
    assert unread == ["section.forgotten"]

    class Whole(BaseModel):
        a: int = 1
        b: int = 2

        def options(self) -> dict:
            return self.model_dump()

    class Handing(BaseModel):
        section: Whole = Whole()

    assert [k for k in leaf_keys(Handing) if not is_read(k, [], Handing)] == []


def test_renamed_and_removed_keys_are_not_in_the_schema():
    valid = set(leaf_keys(RunConfig))
    assert not valid & set(RENAMED_KEYS), "a renamed key is still a key"
    assert not valid & set(REMOVED_KEYS), "a removed key is still a key"
    assert set(RENAMED_KEYS.values()) <= valid, "a rename points at no key"
