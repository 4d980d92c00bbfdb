"""scripts/pyspy_summary.py on a hand-made py-spy raw file."""
import importlib.util


def _load():
    spec = importlib.util.spec_from_file_location("pyspy_summary", "scripts/pyspy_summary.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


RAW = """\
main (a.py:1);loop (a.py:5);send (b.py:10) 6
main (a.py:1);loop (a.py:6);send (b.py:11) 2
main (a.py:1);loop (a.py:5) 2
main (a.py:1);EpollSelector.select (selectors.py:468) 30
io (c.py:3);Poller.poll (zmq/sugar/poll.py:106) 10
"""


def test_busy_samples_by_function_and_by_line(tmp_path):
    """Idle stacks (a selector, a zmq poll) are left out: 10 busy of 50. By function, send
    (b.py) is 8 self, loop 2 self and 10 inclusive, main 10 inclusive; by line, send's two
    lines stay apart (6 and 2)."""
    s = _load()
    raw = tmp_path / "raw.txt"
    raw.write_text(RAW)
    got = s.summarize([str(raw)])
    assert (got["busy_samples"], got["idle_samples"]) == (10, 40)
    assert dict(got["self"]) == {"send (b.py)": 8, "loop (a.py)": 2}
    assert dict(got["inclusive"]) == {"main (a.py)": 10, "loop (a.py)": 10, "send (b.py)": 8}
    by_line = dict(s.summarize([str(raw)], lines=True)["self"])
    assert by_line == {"send (b.py:10)": 6, "send (b.py:11)": 2, "loop (a.py:5)": 2}
