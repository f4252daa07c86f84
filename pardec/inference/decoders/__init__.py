"""Validation decoders behind one interface (``base.Decoder``), looked up by name in ``registry``."""
