"""`cubridge lift`: a user's kernel lifted by the model behind the scripted server, accepted only
after the lift check job (kernel through its launcher vs the CuIR in the interpreter) passes on a
runner worker; here the 'kernel' is a CPU launcher so the whole flow runs without a GPU."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from cubridge.cli import main
from cubridge.llm.regions import strip_markers
from cubridge.paths import ref_kernel_dir

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
from scripted import ScriptedServer, completion, lifting_map  # noqa: E402

KERNEL_CU = (ref_kernel_dir("fa2_sm80") / "kernel.cu").read_text()
KERNEL_CUIR = (ref_kernel_dir("fa2_sm80") / "kernel.cuir").read_text()


def _answer(cuir: str) -> str:
    """The model's answer: the CuIR and the regions as line ranges of the unmarked kernel."""
    return json.dumps({"cuir": cuir, "regions": lifting_map(KERNEL_CU), "notes": "lifted"})


def test_lift_accepts_only_what_the_kernel_agrees_with(tmp_path, capsys):
    kernel = tmp_path / "my_fa2.cu"
    kernel.write_text(strip_markers(KERNEL_CU))
    launcher = tmp_path / "launch.py"
    # the user's 'kernel' here: causal attention computed by torch on the CPU
    launcher.write_text("from cubridge.spec import load_spec\n"
                        "_spec = load_spec('causal')\n"
                        "def launch(q, k, v):\n"
                        "    return _spec.run_reference(q, k, v)\n")
    full = KERNEL_CUIR.replace("CAUSAL=1)", "CAUSAL=0)")        # computes full attention: rejected
    assert full != KERNEL_CUIR
    script = [{"choices": [completion(_answer(full))]}, {"choices": [completion(_answer(KERNEL_CUIR))]}]
    out = tmp_path / "lifted.cuir"
    with ScriptedServer(tmp_path, script) as srv:
        code = main(["lift", str(kernel), "--launcher", str(launcher), "--spec", "causal", "--llm", "openai",
                     "--llm-option", f"base_url={srv.base_url}", "--llm-option", "model=scripted",
                     "--llm-option", "samples=1", "--llm-option", "max_retries=2",
                     "--device", "cpu", "--out", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert out.read_text() == KERNEL_CUIR
    assert out.with_suffix(".cu").read_text() == KERNEL_CU              # markers back where they were
    assert "wrong_answer" in printed and "ok" in printed


def test_lift_needs_a_gpu_for_a_cuda_kernel(tmp_path, capsys, monkeypatch):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code = main(["lift", "k.cu", "--launcher", "l.py", "--spec", "causal", "--llm", "openai"])
    assert code == 2 and "needs a CUDA GPU" in capsys.readouterr().err
