"""Child of the kill -9 test: append records with `commit` sync forever, print each acked seq."""

import sys

from ninfer_kv.journal.events import CODEC, CommitFrontiers, pack
from ninfer_kv.journal.log import Journal, JournalOptions, SyncPolicy


def record(seq: int) -> list:
    return [CommitFrontiers("main", pack(range(seq % 50)), pack([seq] * (seq % 50)))]


if __name__ == "__main__":
    j = Journal.open(sys.argv[1], CODEC, JournalOptions(sync=SyncPolicy.COMMIT,
                                                        segment_bytes=16384))
    while True:
        seq = j.append(record(j.last_seq + 1))
        sys.stdout.write(f"{seq}\n")
        sys.stdout.flush()
