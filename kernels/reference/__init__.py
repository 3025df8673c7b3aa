"""The pure-torch reference of every operation: the oracle the other families are tested against,
and what runs on any device and dtype."""
