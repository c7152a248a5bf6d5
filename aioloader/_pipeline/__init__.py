"""The stages in the order data flows: order, fetch, epoch (admission, assemble: decode and collate,
on_error, outbox: reorder and hand-over), transfer, hand-over to the consumer's thread."""
