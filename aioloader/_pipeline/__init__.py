"""The stages in the order data flows: order, fetch, epoch (decode, reorder, collate), transfer, hand-over."""
