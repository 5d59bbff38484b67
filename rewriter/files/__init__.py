"""Files the package writes and reads itself: writes confined to one directory, and the safetensors files training keeps."""
