"""What the router and the expert workers share: model config, checkpoint reading, the tensor wire codec."""
