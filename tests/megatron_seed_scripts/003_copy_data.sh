mkdir data
cp meg-gpt2* ./data
cp gpt2* ./data
