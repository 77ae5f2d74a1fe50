"""The key list of the scripts that end a job (job hash, token stream, done list, results feed, ...) is
built in one place, `producer.scripts.finish_keys`, and FINISH is called through one method,
`WorkerScripts.finish_job`: a new caller cannot get the order wrong."""
import re

from queue_helpers import REPO_ROOT

# a list that names a job's done list and then the results feed: what the Lua `finish` helper writes
HAND_WRITTEN_KEYS = re.compile(r"\.done\([^)]*\),\s*[\w.]*\.results\b")
FINISH_CALL = re.compile(r"\.finish\(keys=")


def _sources():
    for folder in ("producer", "worker"):
        for path in sorted((REPO_ROOT / folder).rglob("*.py")):
            yield path.relative_to(REPO_ROOT).as_posix(), path.read_text()


def test_the_keys_of_a_script_that_ends_a_job_are_built_only_by_finish_keys():
    found = [name for name, text in _sources() if HAND_WRITTEN_KEYS.search(text)]
    assert found == ["producer/scripts.py"]


def test_finish_is_called_only_through_finish_job():
    found = [name for name, text in _sources() if FINISH_CALL.search(text)]
    assert found == ["worker/scripts.py"]
