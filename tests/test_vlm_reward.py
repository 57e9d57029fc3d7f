"""The `vlm` judge against a local server process that speaks the OpenAI chat protocol (as vLLM and SGLang do):
the score parsed strictly, a malformed answer asked again, then counted, logged and scored NaN (never 0); a
server without the model, or no server, refused at start."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from solrl_engine.rewards import check_reward, load_reward
from solrl_engine.rewards.vlm import parse_score

# the judge: the image's mean brightness x 10, as text; "it looks nice" where the prompt asks for a malformed answer
SERVER = textwrap.dedent('''
    import base64, io, json, sys
    from http.server import BaseHTTPRequestHandler, HTTPServer
    import numpy as np
    from PIL import Image
    class H(BaseHTTPRequestHandler):
        def log_message(self, *a): pass
        def reply(self, obj):
            body = json.dumps(obj).encode()
            self.send_response(200); self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body))); self.end_headers(); self.wfile.write(body)
        def do_GET(self):
            self.reply({"object": "list", "data": [{"id": "judge", "object": "model"}]})
        def do_POST(self):
            req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            text, *images = req["messages"][0]["content"]
            image = images[0]  # an edit's source comes first: the judge here rates the first image it gets
            png = base64.b64decode(image["image_url"]["url"].split(",", 1)[1])
            mean = np.asarray(Image.open(io.BytesIO(png))).mean() / 255
            answer = "it looks nice" if "MALFORMED" in text["text"] else f"{round(10 * mean)}"
            if len(images) != 1 and "edited by the instruction" not in text["text"]:
                answer = "two images without the editing template"
            self.reply({"choices": [{"message": {"role": "assistant", "content": answer}}]})
    HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
''')


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def judge_url():
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-c", SERVER, str(port)])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                break
        except OSError:
            time.sleep(0.1)
    yield f"http://127.0.0.1:{port}"
    proc.kill()
    proc.wait(10)


def test_the_judge_scores_through_the_chat_protocol(judge_url, caplog):
    args = {"vlm": {"url": judge_url, "model": "judge", "retries": "1"}}
    check_reward("vlm", args)
    reward = load_reward("vlm", args)
    judge = reward.parts[0][2]
    images = torch.stack([torch.full((3, 32, 32), v) for v in (0.0, 0.5, 1.0, 0.5)])
    with caplog.at_level("WARNING", logger="solrl_engine.rewards"):
        r = reward(images, ["a cat", "a cat", "a cat", "a MALFORMED answer please"])
    assert r[:3].tolist() == [0.0, 0.5, 1.0]
    assert torch.isnan(r[3]) and judge.malformed == 1  # asked twice, then NaN: never a made-up 0
    assert any("malformed answer 'it looks nice'" in m for m in caplog.messages)


def test_answers_are_parsed_strictly():
    assert parse_score("7", 10) == 7 and parse_score(" 8.5 \n", 10) == 8.5 and parse_score("9.", 10) == 9
    for bad in ("Score: 7", "7/10", "seven", "", "11", "-1", "7 8"):
        assert parse_score(bad, 10) is None, bad


def test_a_judge_that_is_not_there_is_refused_at_start(judge_url):
    with pytest.raises(ValueError, match="needs its judge"):
        check_reward("vlm", {})
    with pytest.raises(ValueError, match=r"serves \['judge'\], not 'other'"):
        load_reward("vlm", {"vlm": {"url": judge_url, "model": "other"}})
    with pytest.raises(ValueError, match="did not answer /v1/models"):
        load_reward("vlm", {"vlm": {"url": f"http://127.0.0.1:{_free_port()}", "model": "judge", "timeout_s": "2"}})
    with pytest.raises(ValueError, match="must hold {prompt}"):
        load_reward("vlm", {"vlm": {"url": judge_url, "model": "judge", "template": "rate it"}})


def test_an_edit_goes_to_the_judge_after_its_source_in_the_editing_template(judge_url, tmp_path):
    """A conditioned prompt: the source image first, then the edit, in the editing template (this judge rates the
    first image it gets, so the score is the source's brightness, not the edit's)."""
    import numpy as np
    from PIL import Image

    from solrl_engine.data import ConditionedPrompt

    Image.fromarray(np.full((24, 24, 3), 204, dtype=np.uint8)).save(tmp_path / "src.png")
    judge = load_reward("vlm", {"vlm": {"url": judge_url, "model": "judge"}})
    edit = torch.full((1, 3, 16, 16), 0.1)
    got = judge(edit, [ConditionedPrompt("make it dark", [tmp_path / "src.png"])])
    assert torch.allclose(got, torch.tensor([0.8]))  # round(10 x 204 / 255) / 10, the source's
    assert torch.allclose(judge(edit, ["a dark square"]), torch.tensor([0.1]))  # a plain prompt: the image's own
