"""Rich output from workers: display() in a rank shows in the launching cell, as in the kernel.

HTML, matplotlib figures and updating displays (display_id, as a transformers Trainer's
progress table uses) published by rank 0 arrive in the launching cell as display_data and
update_display_data; other ranks (and every rank in a plain script) print the text form,
labelled, once per display rather than once per redraw.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from kernel_helpers import execute

pytestmark = pytest.mark.kernel

SHOW = """
def show():
    import matplotlib.pyplot as plt
    rank = int(os.environ["RANK"])
    print("before", rank)
    display(HTML(f"<b>rank {rank} says hi</b>"))
    table = display(HTML("<i>step 0</i>"), display_id=True)
    for step in (1, 2, 3):
        table.update(HTML(f"<i>step {step}</i>"))
    fig, ax = plt.subplots(figsize=(2, 2))
    ax.plot([0, rank])
    plt.show()
    print("after", rank)
    return rank
"""


#: The cells the module's kernel runs first (conftest.py's module_kernel).
KERNEL_SETUP = (
    "%matplotlib inline\nimport os\nfrom IPython.display import display, HTML\n"
    "from nb_dist import notebook_launcher",
    SHOW,
)


def _rich(run, kind="display_data"):
    return [m.content for m in run.mine if m.msg_type == kind]


@pytest.mark.fast
@pytest.mark.timeout(90)
def test_rank0_displays_arrive_rich_in_the_cell(module_kernel):
    _, kc = module_kernel
    run = execute(kc, "notebook_launcher(show, num_processes=2)").expect_ok()
    shown = _rich(run)
    assert [d["data"].get("text/html") for d in shown[:2]] == [
        "<b>rank 0 says hi</b>",
        "<i>step 0</i>",
    ]
    assert "image/png" in shown[2]["data"]  # the figure, from plt.show() in the worker
    assert len(shown) == 3  # rank 1's displays are not shown rich
    updates = _rich(run, "update_display_data")
    assert [u["data"]["text/html"] for u in updates] == [f"<i>step {s}</i>" for s in (1, 2, 3)]
    table_id = shown[1]["transient"]["display_id"]
    assert {u["transient"]["display_id"] for u in updates} == {table_id}
    # Rank 1: its displays' text form, labelled, once each (no line per redraw).
    out = run.stdout()
    assert out.count("[rank 1] <IPython.core.display.HTML object>") == 2
    assert "[rank 1] <Figure size" in out
    assert "[rank 0] <IPython" not in out
    # The order of rank 0's own output holds: its print before its first display.
    kinds = [m.msg_type for m in run.mine if m.msg_type in ("stream", "display_data")]
    texts = [m.content.get("text", "") for m in run.mine if m.msg_type == "stream"]
    first_display = kinds.index("display_data")
    assert any("[rank 0] before 0" in t for t in texts[:first_display])


@pytest.mark.timeout(90)
def test_all_ranks_rich_and_labelled(module_kernel):
    _, kc = module_kernel
    run = execute(kc, "notebook_launcher(show, num_processes=2, rich_output='all')").expect_ok()
    html = sorted(d["data"].get("text/html", "") for d in _rich(run))
    assert "<b>rank 0 says hi</b>" in html and "<b>rank 1 says hi</b>" in html
    assert run.stdout().count("[rank 1] (display)") == 3
    assert "<IPython.core.display.HTML object>" not in run.stdout()
    assert len(_rich(run, "update_display_data")) == 6


@pytest.mark.timeout(90)
def test_grouped_output_keeps_displays_in_rank_order(module_kernel):
    _, kc = module_kernel
    run = execute(kc, "notebook_launcher(show, num_processes=2, output='grouped')").expect_ok()
    order = [
        m.content["data"].get("text/html", "png") if m.msg_type == "display_data" else "stream"
        for m in run.mine
        if m.msg_type in ("display_data", "stream")
    ]
    assert order[:4] == ["stream", "<b>rank 0 says hi</b>", "<i>step 0</i>", "png"]


@pytest.mark.timeout(90)
def test_rich_output_none_prints_text(module_kernel):
    _, kc = module_kernel
    run = execute(kc, "r = notebook_launcher(show, num_processes=1, rich_output='none'); r")
    run.expect_ok()
    assert _rich(run) == []
    assert run.stdout().count("[rank 0] <IPython.core.display.HTML object>") == 2
    logs = execute(kc, "print(r.logs[0])").expect_ok().stdout()
    assert "before 0" in logs and "<Figure size" in logs


@pytest.mark.timeout(90)
def test_a_widget_displayed_in_a_rank_shows_its_text(module_kernel):
    """A widget's model lives in the worker, out of the frontend's reach: its text form."""
    _, kc = module_kernel
    execute(
        kc,
        "def slider():\n"
        "    import ipywidgets\n"
        "    display(ipywidgets.IntSlider(value=3, description='lr'))\n"
        "    return 1",
    ).expect_ok()
    run = execute(kc, "notebook_launcher(slider, num_processes=1)").expect_ok()
    shown = _rich(run)
    assert all("application/vnd.jupyter.widget-view+json" not in d["data"] for d in shown)
    assert any("IntSlider(value=3" in d["data"].get("text/plain", "") for d in shown)


def test_bad_rich_output_is_refused():
    from nb_dist import notebook_launcher

    with pytest.raises(ValueError, match=r"rich_output='rank1' is not supported"):
        notebook_launcher(print, num_processes=1, rich_output="rank1")
    with pytest.raises(ValueError, match=r"a list of ranks such as \[0, 1\]"):
        notebook_launcher(print, num_processes=1, rich_output=[-1])


@pytest.mark.timeout(90)
def test_in_a_plain_script_displays_print_their_text(tmp_path):
    script = tmp_path / "show.py"
    script.write_text(
        textwrap.dedent(
            """
            import os
            from IPython.display import display, HTML
            from nb_dist import notebook_launcher

            def show():
                display(HTML("<b>hi</b>"))
                return 1

            print(notebook_launcher(show, num_processes=2))
            """
        )
    )
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=80)
    assert run.returncode == 0, run.stderr
    assert "LaunchResult([1, 1])" in run.stdout


TRAINER = """
def train_tiny():
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64,
                                       n_positions=16))
    data = [{"input_ids": torch.randint(0, 64, (8,)), "labels": torch.randint(0, 64, (8,))}
            for _ in range(16)]
    args = TrainingArguments(output_dir=OUT, max_steps=4, per_device_train_batch_size=4,
                             logging_steps=1, report_to=[], save_strategy="no", use_cpu=True,
                             disable_tqdm=False)
    Trainer(model=model, args=args, train_dataset=data).train()
    return "trained"
"""


@pytest.mark.timeout(240)
def test_trainer_progress_table_shows_in_the_cell(module_kernel, tmp_path):
    pytest.importorskip("transformers")
    _, kc = module_kernel
    execute(kc, f"OUT = {str(tmp_path)!r}\n" + TRAINER, timeout=60).expect_ok()
    run = execute(kc, "notebook_launcher(train_tiny, num_processes=2)", timeout=220)
    run.expect_ok()
    html = [d["data"].get("text/html", "") for d in _rich(run)]
    html += [u["data"].get("text/html", "") for u in _rich(run, "update_display_data")]
    assert any("<progress" in h for h in html), html[:3]
    # No flood of text placeholders: rank 0's table is rich; rank 1's is its text, once.
    out = run.stdout()
    assert "[rank 0] <IPython.core.display.HTML object>" not in out
    assert out.count("[rank 1] <IPython.core.display.HTML object>") <= 1
