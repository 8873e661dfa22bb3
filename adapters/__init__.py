"""plugvlm adapters: light heads (ComAlign, the grounded relation head, SmartCLIP, PowerCLIP NLA), the pre-training
objectives, their losses, and the scorers evaluation and serving ask.

Library code: never imports ``train`` or ``serve``.
"""

import extract.numerics  # noqa: F401  MKL's reproducible mode before any matrix product
