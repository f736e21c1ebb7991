"""README stays true: .ci/run runs exactly the README's test command."""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _commands():
    text = (ROOT / "README.md").read_text()
    return re.findall(r"```bash\n(.*?)\n```", text, flags=re.S)


def test_ci_runs_the_readme_test_command():
    cmds = [c for c in _commands() if "pytest" in c]
    assert len(cmds) == 1, cmds
    assert cmds[0].strip() in (ROOT / ".ci" / "run").read_text()


def test_readme_main_command_runs_the_parity_cli():
    assert any("-m parity_tests" in c and "pytest" not in c for c in _commands())
