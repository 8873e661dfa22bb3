"""plugvlm adapters: light heads (ComAlign, SmartCLIP, PowerCLIP NLA) and their losses.

Library code: never imports ``train`` or ``serve``.
"""
