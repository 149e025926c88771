"""Tandem's Python client: joins a running Tandem job with the job's secret, lists its workers, and calls the
functions they registered, on the same wire as the C++ workers (protobuf over gRPC, tensors outside protobuf).

    import numpy as np
    import tandem_client

    with tandem_client.connect("10.0.0.1:29500", secret="...") as job:
        print(job.workers())
        action = job.call("agent", "act", np.zeros(4, dtype=np.float32))

It authenticates with the client token derived from the job's secret (client_token(secret)), which workers accept
only for calls as a client and for reading the job's store: it calls only what the job registered (never Tandem's
internal `__tandem.*` functions), sends and receives plain values and tensors (no remote references, no distributed
autograd), and has no rank: workers see it as caller rank -1 (tandem::rpc::kClientRank) under the name it gives.
Hand a process only the client token (TANDEM_CLIENT_TOKEN) and it cannot act as a worker of the job.
"""

from ._client import CLIENT_RANK, Client, Future, Worker, client_token, connect
from ._errors import (AuthenticationError, DeadlineExceeded, EncodeError, RemoteError, TandemError,
                      Unavailable)
from ._version import WIRE_VERSION

__all__ = ["CLIENT_RANK", "Client", "Future", "Worker", "client_token", "connect", "AuthenticationError", "DeadlineExceeded",
           "EncodeError", "RemoteError", "TandemError", "Unavailable", "WIRE_VERSION"]
