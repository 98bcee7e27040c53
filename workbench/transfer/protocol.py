"""The transfer protocol schema moved to ``workbench.protocol.transfer`` (one schema for every kind).

Kept as an alias so existing imports keep working; new code imports ``workbench.protocol``.
"""

from workbench.protocol.transfer import *  # noqa: F401,F403
from workbench.protocol.transfer import (  # noqa: F401
    Evaluation,
    Regime,
    SourceSpec,
    TransferCell,
    TransferData,
    TransferProtocol,
    TransferProtocolError,
    TransferRunSpec,
    parse_transfer_protocol,
)
