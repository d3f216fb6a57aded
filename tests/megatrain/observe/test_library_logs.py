"""Other libraries' records go to a file inside the block, and nowhere else; after it, as before."""

import logging

from megatrain.observe.library_logs import to_file


class Collect(logging.Handler):
    def __init__(self):
        super().__init__()
        self.records: list[str] = []

    def emit(self, record):
        self.records.append(record.getMessage())


def test_a_librarys_records_go_to_the_file_only_while_the_block_runs(tmp_path):
    root, console = logging.getLogger(), Collect()
    root.addHandler(console)
    library = logging.getLogger("distributed.scheduler")
    library.setLevel(logging.INFO)
    try:
        with to_file(tmp_path / "logs" / "dask.log") as path:
            library.info("Register worker addr: tcp://127.0.0.1:1")
            logging.getLogger("megatrain.data").warning("a line of our own")
        library.warning("after the block")
    finally:
        root.removeHandler(console)
        library.setLevel(logging.NOTSET)
    assert "Register worker addr: tcp://127.0.0.1:1" in path.read_text()
    assert "after the block" not in path.read_text()
    assert console.records == ["a line of our own", "after the block"]
    assert logging.getLogger("distributed").propagate
