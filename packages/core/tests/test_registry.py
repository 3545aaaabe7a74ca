from __future__ import annotations

import pytest

from shardforge.core.registry import Registry, import_path


def test_register_get_and_list() -> None:
    reg: Registry[object] = Registry("widget")

    @reg.register("double")
    def double(x: int) -> int:
        """Twice x."""
        return 2 * x

    reg.register_lazy("join", "os.path:join", "os.path.join")
    assert reg.get("double") is double
    assert reg.names() == ["double", "join"]
    assert dict(reg.describe()) == {"double": "Twice x.", "join": "os.path.join"}
    import os.path

    assert reg.get("join") is os.path.join
    assert "join" in reg and "nope" not in reg


def test_unknown_name_lists_registered_ones() -> None:
    reg: Registry[object] = Registry("widget")
    reg.add("a", 1)
    reg.add("b", 2)
    with pytest.raises(ValueError, match=r"unknown widget 'c'; registered: \['a', 'b'\]"):
        reg.get("c")
    with pytest.raises(ValueError, match="already registered"):
        reg.add("a", 3)


def test_import_path_entries() -> None:
    reg: Registry[object] = Registry("widget")
    import json

    assert reg.get("json:dumps") is json.dumps
    assert import_path("os.path:join.__name__") == "join"
    with pytest.raises(ValueError, match="no attribute"):
        reg.get("json:nope")
    with pytest.raises(ValueError, match="cannot import module"):
        import_path("no_such_module_xyz:f")
    with pytest.raises(ValueError, match="not an import path"):
        import_path("json")


def test_import_path_loads_a_python_file_relative_to_the_working_directory(tmp_path, monkeypatch) -> None:
    import pytest

    from shardforge.core.registry import import_path

    (tmp_path / "agents").mkdir()
    (tmp_path / "agents" / "my_agent.py").write_text("CALLS = []\n\ndef run():\n    return 7\n")
    monkeypatch.chdir(tmp_path)
    run = import_path("agents/my_agent.py:run")
    assert run() == 7  # type: ignore[operator]
    assert import_path("agents/my_agent.py:CALLS") is import_path(f"{tmp_path}/agents/my_agent.py:CALLS")  # once
    with pytest.raises(ValueError, match="no such file"):
        import_path("agents/missing.py:run")
