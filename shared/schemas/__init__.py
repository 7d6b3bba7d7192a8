"""Every message that crosses the bus, one module per hop. Wire format: `shared.codec` (msgpack)."""
